"""Device check: every memory-bound subgraph of every committed small model, compiled for CUDA,
run on the GPU and compared with the numpy GIR interpreter on the same random inputs
(per-subgraph, so a wrong kernel is named). Plans are compiled in parallel processes.

    PYTHONPATH=$PWD python3 benchmarks/check_kernels_gpu.py [--out DIR] [--timeout-s 240]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _compile(path: str):
    from powerfusion.compiler import compile_model
    t0 = time.perf_counter()
    try:
        plan = compile_model(path, "cuda")
        return path, pickle.dumps(plan), time.perf_counter() - t0, None
    except Exception as e:
        return path, None, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:600]}"


def check_plan(plan) -> list[dict]:
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor, device_dtype
    from powerfusion.gir.interpreter import np_dtype, run_gir
    rows = []
    rng = np.random.default_rng(0)
    for step in plan.kernel_steps:
        g = step.gir
        feeds = {}
        for b in g.inputs:
            buf = g.buffer(b)
            dt = np_dtype(buf.dtype)
            if dt.kind in "iu":
                feeds[b] = rng.integers(0, 4, buf.size).astype(dt)
            elif dt.kind == "b":
                feeds[b] = rng.random(buf.size) < 0.7
            else:
                feeds[b] = rng.standard_normal(buf.size).astype(dt)
        row = {"subgraph": step.name, "kernels": len(step.kernels), "ops": len(g.ops)}
        try:
            want = run_gir(g, feeds)
            ex = GIRExecutor(g)
            arrays = {b: cupy.asarray(feeds[b].view(device_dtype(g.buffer(b).dtype))) for b in g.inputs}
            for b in g.outputs:
                buf = g.buffer(b)
                poison = np.full(buf.size, np.nan if np_dtype(buf.dtype).kind == "f" else 77, np_dtype(buf.dtype))
                arrays[b] = cupy.asarray(poison.view(device_dtype(buf.dtype)))
            ex(arrays)
            errs = {}
            for b in g.outputs:
                got = cupy.asnumpy(arrays[b]).view(np_dtype(g.buffer(b).dtype)).astype(np.float64)
                ref = want[b].astype(np.float64)
                scale = max(float(np.nanmax(np.abs(ref))) if ref.size else 0.0, 1e-30)
                bad_nan = int(np.sum(np.isnan(got) != np.isnan(ref)))
                diff = np.abs(got - ref)
                errs[b] = {"rel": float(np.nanmax(diff) / scale) if diff.size else 0.0, "nan_mismatch": bad_nan}
            row["errors"] = errs
            row["ok"] = all(e["rel"] < 1e-4 and e["nan_mismatch"] == 0 for e in errs.values())
        except Exception as e:
            row["ok"] = False
            row["exception"] = f"{type(e).__name__}: {str(e)[:600]}"
        rows.append(row)
    return rows


def check_precompiled(plans_dir, out) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from precompile import load_plan
    report = {}
    for p in sorted((ROOT / "models" / "small").glob("*.onnx")):
        plan = load_plan(plans_dir, p.stem)
        if plan is None:
            report[p.stem] = {"compile_error": "not compiled (see compile.json)"}
            print(p.stem, "not compiled", flush=True)
            continue
        rows = check_plan(plan)
        bad = [r for r in rows if not r["ok"]]
        report[p.stem] = {"subgraphs": rows, "ok": not bad, "kernels": sum(r["kernels"] for r in rows)}
        print(p.stem, f"{len(rows) - len(bad)}/{len(rows)} subgraphs ok", flush=True)
        for r in bad:
            print("   BAD", json.dumps(r)[:500], flush=True)
    if out:
        Path(out, "kernel_check.json").write_text(json.dumps(report, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--plans", default=None, help="folder of precompiled plans (precompile.py)")
    ap.add_argument("models", nargs="*")
    args = ap.parse_args(argv)
    if args.plans:
        return check_precompiled(args.plans, args.out)
    paths = [str(p) for p in sorted((ROOT / "models" / "small").glob("*.onnx"))] if not args.models else args.models
    report = {}
    with mp.get_context("fork").Pool(min(len(paths), 12)) as pool:
        jobs = {p: pool.apply_async(_compile, (p,)) for p in paths}
        deadline = time.time() + args.timeout_s
        for p, job in jobs.items():
            name = Path(p).stem
            try:
                _, blob, secs, err = job.get(timeout=max(1, deadline - time.time()))
            except mp.TimeoutError:
                report[name] = {"compile_error": f"compile exceeded {args.timeout_s:.0f} s"}
                print(name, "compile timeout", flush=True)
                continue
            if err:
                report[name] = {"compile_s": secs, "compile_error": err}
                print(name, "compile error", err[:300], flush=True)
                continue
            plan = pickle.loads(blob)
            rows = check_plan(plan)
            report[name] = {"compile_s": secs, "subgraphs": rows,
                            "ok": all(r["ok"] for r in rows), "kernels": sum(r["kernels"] for r in rows)}
            bad = [r for r in rows if not r["ok"]]
            print(name, f"compile {secs:.1f}s", f"{len(rows) - len(bad)}/{len(rows)} subgraphs ok", flush=True)
            for r in bad:
                print("   BAD", json.dumps(r)[:700], flush=True)
        pool.terminate()
    if args.out:
        Path(args.out, "kernel_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
