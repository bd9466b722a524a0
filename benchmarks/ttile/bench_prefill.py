"""Prefill-size benchmark of the tensor-core typed GEMM: M in {1, 16, 64, 128, 256} on the LLaMA-7B /
70B shapes of bench.py, against cuBLAS fp16 in the same run, weights rotated out of L2 (bench.py's
timing). Per M and shape: the scheduler's default (M = 1: the GEMV; 16 <= M: the prefill kernel of
M's bucket) for W4A16, bf16 x int4, NF4 and uint4 with zero points (group 128); for W4A16 also the
candidate tiles (`prefill.CANDIDATE_TILES`) and the paths that ran before the prefill kernel
(the per-tile mma kernel and dequantise + cuBLAS), for NF4 those two as well.
Writes ttile-prefill.json to OUT_DIR (summarize_prefill.py writes the markdown).

    python -m benchmarks.ttile.bench_prefill OUT_DIR [--quick] [--budget SECONDS]
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks.ttile import bench

MS = (1, 16, 64, 128, 256)
COMBOS = [("fp16", "int4", None), ("bf16", "int4", None), ("fp16", "nf4", None), ("fp16", "uint4", "quantized")]
SWEPT = {("fp16", "int4")}
BEFORE = {("fp16", "int4"), ("fp16", "nf4")}


def configs(M, A, W, zm):
    """(label, Matmul keywords) to time for one (M, type)."""
    from powerfusion.ttile import prefill
    from powerfusion.ttile.matmul import Matmul
    base = dict(group_size=128, zeros_mode=zm, out_dtype=A)
    out = [("default", base)]
    if M >= prefill.MIN_M and Matmul(M, 4096, 4096, A, W, **base).kind != "tc":   # the prefill kernel anyway
        out.append(("tc", dict(base, kernel="tc")))
    if M >= prefill.MIN_M and (A, W) in SWEPT:
        out += [(f"tile {t.tag}", dict(base, kernel="tc", tile=t)) for t in prefill.CANDIDATE_TILES
                if t != prefill.tile_for(M) and (t.bm == 16 if M == 16 else 32 <= t.bm <= M)]
    if M >= prefill.MIN_M and (A, W) in BEFORE:
        out += [("before: mma", dict(base, kernel="mma")), ("before: dequant", dict(base, kernel="dequant"))]
    return out


def all_matmuls(quick=False):
    from powerfusion.ttile.matmul import Matmul
    for M in MS:
        for N, K in (bench.SHAPES[:2] if quick else bench.SHAPES):
            for A, W, zm in COMBOS:
                for _, kw in configs(M, A, W, zm):
                    yield Matmul(M, N, K, A, W, **kw)


def main(out_dir: str, quick=False, budget=None):
    import cupy as cp
    from powerfusion.ttile.matmul import Matmul
    t_end = time.time() + budget if budget else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    dev = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    bw, bw_how = bench.copy_bandwidth()
    rows, cut = [], None
    for N, K in (bench.SHAPES[:2] if quick else bench.SHAPES):   # shapes outermost: a cut keeps every M
        for M in MS:
            if t_end and time.time() > t_end:
                cut = f"time budget reached before M={M} N={N} K={K}"
                break
            tc, how = bench.bench_cublas(M, N, K)
            rows.append(dict(M=M, N=N, K=K, A="fp16", W="fp16", config="cublas_fp16", kernel="cublas_fp16",
                             time_us=tc * 1e6, timing=how, speedup=1.0))
            for A, W, zm in COMBOS:
                for label, kw in configs(M, A, W, zm):
                    row = dict(M=M, N=N, K=K, A=A, W=W, zeros=zm, config=label)
                    try:
                        mm = Matmul(M, N, K, A, W, **kw)
                        t, how = bench.bench_typed(mm)
                    except Exception as e:   # recorded, never hidden
                        rows.append(dict(row, error=repr(e)[:300]))
                        continue
                    wb = bench.weight_bytes(mm)
                    tile = mm.spec.tile.tag if mm.kind == "tc" else None
                    splits = mm._tc_launch(M)[2] if mm.kind == "tc" else None
                    rows.append(dict(row, kernel=mm.kind, tile=tile, splits=splits, time_us=t * 1e6, timing=how,
                                     weight_bytes=wb, frac_copy_bw=wb / t / bw, speedup=tc / t,
                                     tflops=2 * M * N * K / t / 1e12))
                    print(f"M={M} {N}x{K} {A}x{W} {label} {mm.kind} {tile or ''} s={splits}: {t * 1e6:.1f} us "
                          f"({tc / t:.2f}x cuBLAS {tc * 1e6:.1f} us, {wb / t / bw:.0%} BW)", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
            _write(out, dev, bw, bw_how, rows, cut)
        if cut:
            break
    _write(out, dev, bw, bw_how, rows, cut)


def _write(out, dev, bw, bw_how, rows, cut):
    import datetime
    import cupy as cp
    meta = dict(device=dev, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=bench.git_commit(), copy_bandwidth_GBps=bw / 1e9, copy_bandwidth_by=bw_how, cupy=cp.__version__,
                method="CUDA events over CUDA-graph replays, buffers rotated over >256 MiB", incomplete=cut)
    (out / "ttile-prefill.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    b = bench._arg("--budget")
    main(sys.argv[1], "--quick" in sys.argv, float(b) if b else None)
