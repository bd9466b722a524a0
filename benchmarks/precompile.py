"""Compile many models in parallel processes (the compile pipeline is single-threaded Python)
and keep each Plan as a pickle, so GPU scripts spend their device time on the device.

    PYTHONPATH=$PWD python3 benchmarks/precompile.py --out DIR [--timeout-s 150] [--jobs 14]

Compiles every committed small model and every benchmark case (gir_cases.py). Writes
DIR/<key>.pkl and DIR/compile.json (seconds or the error per key).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def case_key(case) -> str:
    return f"{case.name}-{case.dtype}"


def jobs(suites=("subgraphs", "norms", "models")) -> dict:
    import gir_cases
    out = {}
    cases = gir_cases.cases_for([s for s in suites if s != "models"])
    for case in cases:  # benchmark cases first
        out[case_key(case)] = case.model.SerializeToString()
    if "models" in suites:
        out.update({p.stem: str(p) for p in sorted((ROOT / "models" / "small").glob("*.onnx"))})
    return out


def _compile(key, model, out_dir, tune=False):
    from powerfusion.compiler import compile_model
    t0 = time.perf_counter()
    try:
        plan = compile_model(model, "cuda", tune=tune)
        Path(out_dir, f"{key}.pkl").write_bytes(pickle.dumps(plan))
        return key, time.perf_counter() - t0, None
    except Exception as e:
        return key, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:500]}"


def load_plan(plans_dir, key):
    p = Path(plans_dir, f"{key}.pkl")
    return pickle.loads(p.read_bytes()) if p.exists() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=150)
    ap.add_argument("--jobs", type=int, default=max(1, (mp.cpu_count() or 2) - 2))
    ap.add_argument("--suites", nargs="+", default=["subgraphs", "norms", "models"])
    ap.add_argument("--skip-existing", action="store_true", help="keep plans already in --out")
    ap.add_argument("--tune", action="store_true",
                    help="time the model's top plans on the device and keep the measured best (as compile --tune)")
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    work = jobs(args.suites)
    if args.skip_existing:
        work = {k: m for k, m in work.items() if not Path(args.out, f"{k}.pkl").exists()}
    report = {}
    t0 = time.time()
    with mp.get_context("fork").Pool(args.jobs, maxtasksperchild=1) as pool:
        pending = {k: pool.apply_async(_compile, (k, m, args.out, args.tune)) for k, m in work.items()}
        for k, job in pending.items():
            try:
                _, secs, err = job.get(timeout=max(1.0, t0 + args.timeout_s - time.time()))
                report[k] = {"compile_s": round(secs, 2), "tuned": args.tune} if err is None else \
                    {"compile_s": round(secs, 2), "error": err}
            except mp.TimeoutError:
                report[k] = {"error": f"compile did not finish within {args.timeout_s:.0f} s (all jobs share it)"}
            print(k, report[k], flush=True)
        pool.terminate()
    old = Path(args.out, "compile.json")
    if args.skip_existing and old.exists():
        report = {**json.loads(old.read_text()), **report}
    old.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
