"""Per-kernel device times of benchmark cases' plans (a diagnostic, not a benchmark row).

    PYTHONPATH=$PWD python3 benchmarks/diag/kernel_times.py --only decode_attention [--plans DIR] [--json OUT]

For each kernel of each memory-bound step: its grid, registers per thread, local-memory bytes
(spills), the bytes of its global parameters and its mean time over repeated launches with
random inputs. Input sets are not rotated, so kernels touching less than L2 read from L2 and
their GB/s are optimistic: use it to find the slow kernel, quote bench_gir.py for fractions.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def kernel_rows(plan, repeats: int = 30) -> list[dict]:
    import cupy
    import numpy as np
    from powerfusion.backends.cuda.executor import GIRExecutor, device_dtype
    from powerfusion.gir.interpreter import np_dtype
    rows = []
    for step in plan.kernel_steps:
        ex = GIRExecutor(step.gir, sources=step.kernels)
        env = dict(ex.scratch)
        rng = np.random.default_rng(0)
        for name in list(step.gir.inputs) + list(step.gir.outputs):
            b = step.gir.buffer(name)
            host = rng.standard_normal(b.size).astype(np_dtype(b.dtype)) if np_dtype(b.dtype).kind == "f" \
                else np.zeros(b.size, np_dtype(b.dtype))
            env[name] = cupy.asarray(host.view(device_dtype(b.dtype)) if b.dtype == "bfloat16" else host)
        for lk in ex.kernels:
            args = [env[n] for n, _, _ in lk.source.params]
            nbytes = sum(int(a.nbytes) for a in args)

            def launch():
                lk.kernel.launch(lk.source.grid, lk.source.block, args, shared_mem=lk.source.shared_bytes)
            launch()
            cupy.cuda.get_current_stream().synchronize()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(repeats):
                launch()
            end.record()
            end.synchronize()
            us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / repeats
            fn = lk.kernel.function
            rows.append({"step": step.name, "kernel": lk.source.name, "grid": lk.source.grid[0],
                         "block": lk.source.block[0], "shared": lk.source.shared_bytes,
                         "regs": getattr(fn, "num_regs", None), "local_bytes": getattr(fn, "local_size_bytes", None),
                         "param_bytes": nbytes, "us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)})
    return rows


def main(argv=None) -> int:
    import gir_cases
    from precompile import case_key, load_plan
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="substring filter on case names")
    ap.add_argument("--plans", default=None, help="folder of precompiled plans (precompile.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    for case in gir_cases.subgraph_cases() + gir_cases.norm_cases():
        if args.only not in case.name:
            continue
        plan = load_plan(args.plans, case_key(case)) if args.plans else None
        if plan is None:
            from powerfusion.compiler import compile_model
            plan = compile_model(case.model, "cuda")
        rows = kernel_rows(plan)
        out[case_key(case)] = rows
        print(f"== {case_key(case)}: {sum(r['us'] for r in rows):.1f} us in {len(rows)} kernels", flush=True)
        for r in rows:
            print("   " + "  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
