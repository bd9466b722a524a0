"""Typed-GEMM benchmark: every weight type at M in {1, 4, 16, 64, 256} on LLaMA-7B and -70B
linear shapes, against cuBLAS fp16 in the same run and against the bandwidth floor of the
packed weight bytes (weight + scale bytes / measured copy bandwidth).

Device time from CUDA events around replays of a CUDA graph that launches the kernel over
rotated buffer sets (total > 256 MiB, more than 2x L2, so weights come from HBM every time).
Packed weights are random words: timing does not depend on the values (correctness is the
GPU tests' job). int8-activation rows time the GEMM on int8 activations; the per-row rounding
that MatMulLowBit's act_dtype int8 adds (one more launch over A) is not included.
Writes ttile.json (and summarize.py ttile.md) to OUT_DIR.

    python -m benchmarks.ttile.bench OUT_DIR [--quick] [--m1-only] [--budget SECONDS]
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES_70B = [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]   # N x K: qkv, o, gate+up, down
SHAPES_7B = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
SHAPES = SHAPES_70B + SHAPES_7B
MS = (1, 4, 16, 64, 256)
ROTATE_BYTES = 256 << 20
# (A, W, zeros): every weight type with fp16 activations, the int8-activation kernels, bf16 int4
COMBOS = [("fp16", w, zm) for w, zm in (
    ("int4", None), ("uint4", "quantized"), ("nf4", None), ("fp4_e2m1", None), ("mxfp4", None),
    ("fp8_e4m3", None), ("mxfp8", None), ("int8", None), ("int2", None), ("int1", None))]
COMBOS += [("bf16", "int4", None), ("int8", "int4", None), ("int8", "int2", None), ("int8", "int1", None),
           ("int8", "int8", None)]
# the profiling step of hint-based scheduling at M = 1: (rows per warp, warps per block) candidates
# (R, warps, stages, batch): rows per warp, warps per block, steps in flight, chunks per row and step
M1_TILINGS = [(None, None, None, None), (2, 8, 2, 1), (2, 8, 2, 2), (2, 8, 2, 4), (4, 8, 2, 2), (4, 8, 2, 4),
              (2, 8, 3, 2), (1, 8, 2, 8), (2, 4, 2, 4), (4, 4, 2, 4)]
SWEPT = {("fp16", "int4"), ("fp16", "nf4"), ("fp16", "fp4_e2m1"), ("fp16", "fp8_e4m3"), ("int8", "int2"),
         ("fp16", "int1"), ("fp16", "int2"), ("int8", "int1")}


def configs(M, A, W, zm):
    """Matmul keyword sets to time for one (M, type): the default, plus tilings at M = 1."""
    base = dict(group_size=None if W.startswith("mx") else 128, zeros_mode=zm,
                out_dtype="fp16" if A == "int8" else A)
    tilings = M1_TILINGS if M == 1 and (A, W) in SWEPT else [(None, None, None, None)]
    return [dict(base, rows_per_warp=R, warps=wp, stages=st, batch=b) for R, wp, st, b in tilings]


def all_matmuls(quick=False, m1_only=False):
    """Every Matmul the benchmark launches (precompile.py compiles them in parallel first)."""
    from powerfusion.ttile.matmul import Matmul
    for M in ((1,) if m1_only else MS):
        for N, K in (SHAPES[:2] if quick else SHAPES):
            for A, W, zm in COMBOS:
                for kw in configs(M, A, W, zm):
                    yield Matmul(M, N, K, A, W, **kw)


def timed(launches, graph_len=24, replays=10, bind=None):
    """(seconds per launch, "graph" | "stream"); launches[i] runs on buffer set i (rotated);
    bind(stream), if given, is called before the first launch."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    if bind is not None:
        bind(stream)
    with stream:
        for f in launches:
            f()
        stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        launches[0]()
        e1.record(stream)
        e1.synchronize()
        if cp.cuda.get_elapsed_time(e0, e1) > 1.0:   # > 1 ms a launch: fewer replays (same rotation)
            graph_len, replays = max(4, len(launches)), 2
        try:
            stream.begin_capture()
            for i in range(graph_len):
                launches[i % len(launches)]()
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            e0.record(stream)
            for _ in range(replays):
                graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / (replays * graph_len), "graph"
        except Exception:   # capture unsupported for this path (cuBLAS through CuPy): back-to-back launches
            if stream.is_capturing():
                stream.end_capture()
            e0.record(stream)
            n = graph_len * replays
            for i in range(n):
                launches[i % len(launches)]()
            e1.record(stream)
            e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / n, "stream"


def copy_bandwidth():
    """Read + write bytes/s of a 1 GiB device copy, as the memory-bound suites measure it
    (benchmarks/harness.py, torch) where torch is installed; else a CuPy memcpy."""
    try:
        from benchmarks.harness import copy_bandwidth as torch_copy_bandwidth
        return torch_copy_bandwidth(), "torch copy_"
    except ImportError:
        import cupy as cp
        n = 1 << 30
        src, dst = cp.ones(n, cp.uint8), cp.empty(n, cp.uint8)
        t, _ = timed([lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3,
                                                          cp.cuda.get_current_stream().ptr)], graph_len=4, replays=5)
        return 2 * n / t, "cudaMemcpyAsync"


def n_sets(nbytes):
    return max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1)))


@functools.lru_cache(maxsize=1)
def _blas_handle():
    from powerfusion.backends.cuda import blas
    return blas.Blas()


def bench_cublas(M, N, K):
    """cuBLAS fp16 (fp32 accumulation) through the CUDA session's own handle (backends/cuda/blas.py),
    which graph capture accepts; where that is unavailable, cupy.matmul timed back to back on a
    stream (its per-call host overhead then counts: small shapes look slower than they are)."""
    import cupy as cp
    w0 = cp.random.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
    sets = [(cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16),
             w0 if i == 0 else w0.copy(), cp.empty((M, N), cp.float16)) for i in range(n_sets(N * K * 2))]
    try:
        handle = _blas_handle()
        # the handle keeps the stream of the last timed() call, destroyed since: rebind first (before
        # this, every call after the first shape failed with status 13 and fell back to cupy.matmul)
        handle.bind(cp.cuda.get_current_stream())
        if not handle.gemm_into(sets[0][0], sets[0][1], sets[0][2], trans_b=True):
            raise RuntimeError("gemm_into refused the operands")
        return timed([lambda s=s: handle.gemm_into(s[0], s[1], s[2], trans_b=True) for s in sets], bind=handle.bind)
    except Exception as e:   # no usable cuBLAS handle of ours: CuPy's matmul, eager
        print(f"cuBLAS through blas.Blas unavailable ({e!r}); timing cupy.matmul on a stream", flush=True)
        return timed([lambda s=s: cp.matmul(s[0], s[1].T, out=s[2]) for s in sets])


def weight_bytes(mm) -> int:
    """Packed weight words plus scales / zero points: what must cross HBM at least once."""
    s = mm.spec
    ng = s.K_pad // s.group_size
    scale = 1 if s.zmode == "mx" else 2
    zeros = {"quantized": 1, "original": 2, "rescale": 2}.get(s.zeros_mode, 0)
    return mm.N * s.K_pad * s.bits // 8 + mm.N * ng * (scale + zeros)


def bench_typed(mm):
    import cupy as cp
    s = mm.spec
    M, N, K = mm.M, mm.N, mm.K
    words = N * s.K_pad * s.bits // 32
    ng = s.K_pad // s.group_size
    rows = s.N_pad if mm.kind == "mma" else N
    words = rows * s.K_pad * s.bits // 32
    a_dt = {"fp16": cp.float16, "bf16": cp.uint16, "int8": cp.int8}[s.A_dtype]
    sets = []
    for _ in range(n_sets(weight_bytes(mm))):
        w = cp.random.randint(0, 1 << 31, words, dtype=cp.int64).astype(cp.uint32)
        sc = (cp.random.randint(0, 8, rows * ng, dtype=cp.int32).astype(cp.uint8) + 120) if s.zmode == "mx" else \
            cp.full(rows * ng, 0.01, cp.float16)
        z = cp.random.randint(0, 16, rows * ng, dtype=cp.int32).astype(cp.uint8) if s.zeros_mode == "quantized" else None
        a = cp.random.standard_normal((M, K), dtype=cp.float32)
        a = (a.view(cp.uint32) >> 16).astype(cp.uint16) if s.A_dtype == "bf16" else (a * 30).astype(a_dt)
        out = cp.empty((M, N), cp.uint16 if s.out_dtype == "bf16" else cp.float16)
        sets.append((a, [w, sc, z, None], out))
    t, how = timed([lambda st=st: mm(st[0], st[1], out=st[2]) for st in sets])
    return t, how


def git_commit():
    if os.environ.get("POWERFUSION_GIT_COMMIT"):   # the device copy's git metadata is stale
        return os.environ["POWERFUSION_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def main(out_dir: str, quick=False, m1_only=False, budget=None):
    import cupy as cp
    from powerfusion.ttile.matmul import Matmul
    t_end = time.time() + budget if budget else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    dev = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    bw, bw_how = copy_bandwidth()
    rows, cut = [], None
    for M in ((1,) if m1_only else MS):
        for N, K in (SHAPES[:2] if quick else SHAPES):
            if t_end and time.time() > t_end:
                cut = f"time budget reached before M={M} N={N} K={K}"
                break
            tc, how = bench_cublas(M, N, K)
            rows.append(dict(M=M, N=N, K=K, A="fp16", W="fp16", kernel="cublas_fp16", time_us=tc * 1e6,
                             timing=how, weight_bytes=N * K * 2, frac_copy_bw=N * K * 2 / tc / bw, speedup=1.0))
            for A, W, zm in COMBOS:
                for kw in configs(M, A, W, zm):
                    row = dict(M=M, N=N, K=K, A=A, W=W, zeros=zm, R=kw["rows_per_warp"], warps=kw["warps"],
                               stages=kw["stages"], batch=kw["batch"])
                    try:
                        mm = Matmul(M, N, K, A, W, **kw)
                        t, how = bench_typed(mm)
                    except Exception as e:   # recorded, never hidden
                        rows.append(dict(row, error=repr(e)[:300]))
                        continue
                    wb = weight_bytes(mm)
                    rows.append(dict(row, kernel=mm.kind, R=mm.spec.R, warps=mm.spec.warps, stages=mm.spec.stages,
                                     batch=mm.spec.batch,
                                     default=kw["rows_per_warp"] is None and kw["warps"] is None,
                                     time_us=t * 1e6, timing=how, weight_bytes=wb, floor_us=wb / bw * 1e6,
                                     frac_copy_bw=wb / t / bw, speedup=tc / t))
                    print(f"M={M} {N}x{K} {A}x{W} {mm.kind} R={mm.spec.R} w={mm.spec.warps} p={mm.spec.stages} "
                          f"b={mm.spec.batch}: "
                          f"{t * 1e6:.1f} us "
                          f"({tc / t:.2f}x cuBLAS, {wb / t / bw:.0%} of copy BW)", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
            _write(out, dev, bw, bw_how, rows, cut)   # after every shape: a time-out keeps what was measured
        if cut:
            break
    _write(out, dev, bw, bw_how, rows, cut)


def _write(out, dev, bw, bw_how, rows, cut):
    import cupy as cp
    meta = dict(device=dev, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=git_commit(), copy_bandwidth_GBps=bw / 1e9, copy_bandwidth_by=bw_how, cupy=cp.__version__,
                method="CUDA events over CUDA-graph replays, buffers rotated over >256 MiB", incomplete=cut)
    (out / "ttile.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def _arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    b = _arg("--budget")
    main(sys.argv[1], "--quick" in sys.argv, "--m1-only" in sys.argv, float(b) if b else None)
