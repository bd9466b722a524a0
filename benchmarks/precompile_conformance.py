"""Compile the plans of every ONNX node conformance case for the cuda target, on a machine
without a GPU, so tests/conformance/test_cuda_conformance.py spends its device time running.

    PYTHONPATH=$PWD python3 benchmarks/precompile_conformance.py [--out out/conformance-plans]
        [--jobs N] [--budget-s S] [-k TEXT]

Also compiles the float16 / bfloat16 models and subgraphs of tests/backends/test_cuda_dtypes.py
(OUT/dtypes.<name>.<dtype>.pkl.gz). Per conformance case: the case as given; where that is declined or fails, the case with its shape-like
inputs bound per data set (as node_cases.run_case retries). Writes OUT/<case>.<variant>.pkl.gz
(the Plan without its pre-rewrite graph and trace) and OUT/manifest.json: the compiler source
hash, then per "<case>/<variant>" the status (compiled | unsupported | opset | error), its
detail, the file and the compile seconds. Cases not done within the budget are left out (the
test compiles those itself). Compiling needs no GPU; the plans are pickles, so run the test
with the same sources (the test checks the hash).
"""
from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
sys.path.insert(0, str(ROOT / "tests" / "backends"))

import test_cuda_conformance as tc  # noqa: E402
from node_cases import all_cases  # noqa: E402


def compile_case(name: str, out: str) -> dict:
    case = all_cases()[name]
    entries = {}

    def keep(variant, model):
        t0 = time.perf_counter()
        plan, status, detail = tc.compile_classified(name, model)
        entry = {"status": status, "detail": detail, "compile_s": round(time.perf_counter() - t0, 3)}
        if plan is not None:
            entry["file"] = f"{name}.{variant}.pkl.gz"
            Path(out, entry["file"]).write_bytes(gzip.compress(pickle.dumps(plan, protocol=5), 6))
        entries[f"{name}/{variant}"] = entry
        return status

    if keep("given", case.model) != "compiled":
        for _, _, _, (variant, model, _, bound) in tc.variants(case):
            if bound:
                keep(variant, model)
    return entries


def compile_dtype_case(key: str, out: str) -> dict:
    """One float16 / bfloat16 case of tests/backends/test_cuda_dtypes.py (compiled, or its error)."""
    import test_cuda_dtypes as td
    build = dict(td.dtype_cases())[key]
    t0 = time.perf_counter()
    entry = {"status": "compiled", "detail": ""}
    try:
        plan = tc.slim(compile_model_cuda(build()))
        entry["file"] = key.replace("/", ".") + ".pkl.gz"
        Path(out, entry["file"]).write_bytes(gzip.compress(pickle.dumps(plan, protocol=5), 6))
    except Exception as e:  # the test compiles it again and fails there, with the message
        entry = {"status": "error", "detail": tc._where(e)}
    entry["compile_s"] = round(time.perf_counter() - t0, 3)
    return {key: entry}


def compile_model_cuda(model):
    from powerfusion.compiler import compile_model
    return compile_model(model, "cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(tc.PLANS_DIR))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--budget-s", type=float, default=3600.0, help="wall-clock limit for all cases together")
    ap.add_argument("-k", help="only conformance cases whose name contains this text")
    ap.add_argument("--no-dtypes", action="store_true", help="skip the float16 / bfloat16 cases of test_cuda_dtypes.py")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.pkl.gz")) + [out / "manifest.json"]:
        old.unlink(missing_ok=True)
    names = [n for n in sorted(all_cases()) if not args.k or args.k in n]  # loaded before forking
    dtype_keys = [] if args.no_dtypes else [k for k, _ in __import__("test_cuda_dtypes").dtype_cases()]
    t0 = time.time()
    entries, late = {}, []
    with mp.get_context("fork").Pool(args.jobs, maxtasksperchild=100) as pool:
        # the dtype models take longest: first, so they do not finish last
        jobs = {k: pool.apply_async(compile_dtype_case, (k, str(out))) for k in dtype_keys}
        jobs.update({n: pool.apply_async(compile_case, (n, str(out))) for n in names})
        for n, job in jobs.items():
            try:
                entries.update(job.get(timeout=max(0.1, t0 + args.budget_s - time.time())))
            except mp.TimeoutError:
                late.append(n)
        pool.terminate()
    for n in late:  # a late job may have written its file: the manifest does not name it
        for f in out.glob(f"{n.replace('/', '.')}.*pkl.gz"):
            f.unlink()
    seconds = time.time() - t0
    doc = {"source_hash": tc.source_hash(), "cases": len(names) + len(dtype_keys), "late": late,
           "wall_s": round(seconds, 1), "jobs": args.jobs, "entries": entries}
    (out / "manifest.json").write_text(json.dumps(doc, indent=0))
    by = {}
    for e in entries.values():
        by[e["status"]] = by.get(e["status"], 0) + 1
    size = sum(f.stat().st_size for f in out.iterdir())
    cpu = sum(e["compile_s"] for e in entries.values())
    print(f"{len(names)} conformance + {len(dtype_keys)} dtype cases in {seconds:.0f} s wall ({cpu:.0f} s compiling, {args.jobs} jobs): "
          f"{by}; {len(late)} not done in the budget; {size / 2**20:.1f} MiB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
