"""The M = 1 typed GEMV's tiling knobs one at a time, on the benchmark's shapes (a diagnostic).

    PYTHONPATH=$PWD python3 benchmarks/diag/gemv_variants.py [--json OUT] [--types fp16:int4,int8:int2]

Each variant changes one or two of: rows per warp (R), warps per block, split-K across the
block's warps, steps in flight (stages), chunks per step (batch), activations staged in
shared memory (stage_a). Timed with the typed-GEMM benchmark's harness (CUDA-graph replays,
buffers rotated past L2); kernels compiled in parallel first.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = [(4096, 4096), (4096, 11008), (12288, 4096), (22016, 4096), (10240, 8192), (8192, 28672)]
VARIANTS = {
    "default": {},
    "no-stage-a": dict(stage_a=False),
    "b4": dict(batch=4),
    "b4 no-stage-a": dict(batch=4, stage_a=False),
    "b2": dict(batch=2),
    "R1 w8 b4": dict(rows_per_warp=1, warps=8, batch=4),
    "R2 w16": dict(rows_per_warp=2, warps=16),
    "R4 ks4": dict(rows_per_warp=4, warps=4, ksplit=4),
    "R8 ks8": dict(rows_per_warp=8, warps=8, ksplit=8),
    "R4 ks8 b2": dict(rows_per_warp=4, warps=8, ksplit=8, batch=2),
    "p3": dict(stages=3),
}
# at M > 1: the scheduler's choice (the tensor-core prefill kernel from M = 16) against the
# CUDA-core kernel with MT activation rows per block
VARIANTS_M = {
    "default": {},
    "gemv": dict(kernel="gemv"),
    "gemv R2": dict(kernel="gemv", rows_per_warp=2),
    "gemv R8": dict(kernel="gemv", rows_per_warp=8),
    "gemv w8": dict(kernel="gemv", warps=8),
    "gemv R2 w8": dict(kernel="gemv", rows_per_warp=2, warps=8),
}


def matmuls(types, M=1):
    from powerfusion.ttile.matmul import Matmul
    for A, W in types:
        for N, K in SHAPES:
            for label, kw in (VARIANTS if M == 1 else VARIANTS_M).items():
                yield label, Matmul(M, N, K, A, W, group_size=128, out_dtype="fp16" if A == "int8" else A, **kw)


def _compile(item):
    from powerfusion.ttile.runtime import compile_kernel
    try:
        compile_kernel(*item)
    except Exception as e:
        return f"{item[1]}: {e}"[:500]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--types", default="fp16:int4,fp16:nf4,int8:int2")
    ap.add_argument("--m", type=int, default=1, help="activation rows")
    args = ap.parse_args()
    types = [tuple(t.split(":")) for t in args.types.split(",")]
    items = {mm.name: (mm.source, mm.name) for _, mm in matmuls(types, args.m)}
    with mp.get_context("spawn").Pool(16) as pool:
        errs = [e for e in pool.map(_compile, list(items.values())) if e]
    print(f"compiled {len(items)} kernels, {len(errs)} failed", *errs[:3], sep="\n", flush=True)
    from benchmarks.ttile.bench import bench_cublas, bench_typed, copy_bandwidth, weight_bytes
    bw, _ = copy_bandwidth()
    rows = []
    cublas = {(N, K): bench_cublas(args.m, N, K)[0] for N, K in SHAPES}
    for label, mm in matmuls(types, args.m):
        s = mm.spec
        try:
            t, _ = bench_typed(mm)
        except Exception as e:
            rows.append(dict(A=s.A_dtype, W=s.W_dtype, N=mm.N, K=mm.K, variant=label, error=repr(e)[:300]))
            continue
        frac = weight_bytes(mm) / t / bw
        rows.append(dict(A=s.A_dtype, W=s.W_dtype, M=mm.M, N=mm.N, K=mm.K, variant=label, kernel=mm.kind, R=s.R,
                         warps=s.warps, ksplit=s.ksplit, stages=s.stages, batch=s.batch, time_us=t * 1e6,
                         frac_copy_bw=frac, vs_cublas_fp16=cublas[(mm.N, mm.K)] / t))
    for A, W in types:
        key = "frac_copy_bw" if args.m == 1 else "vs_cublas_fp16"
        print(f"\n{A} x {W}, M = {args.m}: {key}", flush=True)
        print(f"{'variant':16s}" + "".join(f"{f'{n}x{k}':>12s}" for n, k in SHAPES))
        for label in (VARIANTS if args.m == 1 else VARIANTS_M):
            vals = {(r["N"], r["K"]): r.get(key) for r in rows
                    if r["variant"] == label and (r["A"], r["W"]) == (A, W)}
            if vals:
                print(f"{label:16s}" + "".join(f"{vals[s]:12.2f}" if vals.get(s) else f"{'err':>12s}" for s in SHAPES))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_bandwidth_GBps=bw / 1e9, rows=rows), indent=1))


if __name__ == "__main__":
    main()
