"""Typed-GEMM benchmark: LLaMA-70B linear shapes, typed kernels vs cuBLAS fp16 (CuPy).

Device time from CUDA events around replays of a CUDA graph that launches the kernel
over rotated buffer sets (total > 2x L2, so weights come from HBM every time).
Packed weights are random words: timing does not depend on the values (correctness is
the GPU tests' job). Writes JSON and a markdown table.

    python -m benchmarks.ttile.bench OUT_DIR [--quick]
"""
from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

SHAPES = [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]   # N x K
ROTATE_BYTES = 256 << 20
M1_COMBOS = [("fp16", w, zm) for w, zm in (
    ("int4", None), ("uint4", "quantized"), ("uint4", "original"), ("nf4", None), ("fp4_e2m1", None),
    ("mxfp4", None), ("int2", None), ("int1", None), ("int8", None), ("fp8_e4m3", None), ("mxfp8", None))]
M1_COMBOS += [("bf16", "int4", None), ("bf16", "nf4", None), ("bf16", "int2", None),
              ("int8", "int8", None), ("int8", "int4", None), ("int8", "int2", None)]
BIG_COMBOS = [("fp16", "int4", None), ("fp16", "nf4", None), ("bf16", "int4", None), ("int8", "int2", None)]


TUNED = {("fp16", "int4"), ("bf16", "int4"), ("int8", "int2"), ("int8", "int4"), ("fp16", "int2"), ("fp16", "int8")}


def variants(M, A, W):
    """(rows per warp, ksplit) candidates: the profiling step of hint-based scheduling."""
    if M == 1 and (A, W) in TUNED:
        return [(None, None, None), (2, 1, None), (4, 1, None), (8, 1, None), (4, 4, None), (8, 4, None)]
    if M > 1 and A != "int8":   # every path the scheduler chooses between
        return [(None, None, k) for k in ("mma", "gemv", "dequant")]
    return [(None, None, None)]


def timed(launches, graph_len=24, replays=10):
    """Seconds per launch; launches[i] runs on buffer set i (rotated)."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in launches:
            f()
        stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
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
        except Exception:   # capture unsupported for this path: plain back-to-back launches
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
    """Read + write bytes/s of a device copy over 1 GiB, measured as the memory-bound suites do
    (benchmarks/harness.py, torch's copy) when torch is there. CuPy copies timed in graphs here
    gave 2.77 TB/s on an H200 where torch's copy gives 4.25, which overstated every fraction."""
    try:
        from benchmarks.harness import copy_bandwidth as torch_copy_bandwidth
        return torch_copy_bandwidth()
    except ImportError:
        import cupy as cp
        n = 1 << 28   # float32 elements: 1 GiB
        src, dst = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
        t, _ = timed([lambda: cp.copyto(dst, src)], graph_len=4, replays=5)
        return 2 * 4 * n / t


def n_sets(nbytes):
    return max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1)))


def bench_cublas(M, N, K):
    import cupy as cp
    w0 = cp.random.standard_normal((N, K), dtype=cp.float32).astype(cp.float16)
    sets = [(cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16),
             w0 if i == 0 else w0.copy(), cp.empty((M, N), cp.float16)) for i in range(n_sets(N * K * 2))]
    t, how = timed([lambda s=s: cp.matmul(s[0], s[1].T, out=s[2]) for s in sets])
    return t, how, N * K * 2 + M * K * 2 + M * N * 2


def bench_typed(M, N, K, A, W, zm, R=None, ks=None, kernel=None):
    import cupy as cp
    from powerfusion.ttile.matmul import Matmul
    mm = Matmul(M, N, K, A, W, group_size=None if W.startswith("mx") else 128, zeros_mode=zm,
                out_dtype="fp16" if A == "int8" else A, rows_per_warp=R, ksplit=ks, kernel=kernel)
    s = mm.spec
    words = N * s.K_pad * s.bits // 32
    ng = s.K_pad // s.group_size
    wbytes = words * 4 + N * ng * (1 if s.zmode == "mx" else 2) * (2 if zm in ("original", "rescale") else 1)
    a_dt = {"fp16": cp.float16, "bf16": cp.uint16, "int8": cp.int8}[A]
    sets = []
    for _ in range(n_sets(wbytes)):
        w = cp.random.randint(0, 256, words * 4, dtype=cp.uint8).view(cp.uint32)
        sc = (cp.random.randint(0, 8, N * ng, dtype=cp.uint8) + 120) if s.zmode == "mx" else \
            cp.full(N * ng, 0.01, cp.float16)
        z = None
        if zm == "quantized":
            z = cp.random.randint(0, 16, N * ng, dtype=cp.uint8)
        elif zm in ("original", "rescale"):
            z = cp.full(N * ng, 7.5, cp.float16)
        a = cp.random.standard_normal((M, K), dtype=cp.float32)
        if A == "bf16":
            a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
        else:
            a = (a * 30).astype(a_dt)
        out = cp.empty((M, N), cp.uint16 if s.out_dtype == "bf16" else cp.float16)
        sets.append((a, [w, sc, z, None], out))
    t, how = timed([lambda st=st: mm(st[0], st[1], out=st[2]) for st in sets])
    a_bytes = M * K * {"fp16": 2, "bf16": 2, "int8": 1}[A]
    return t, how, wbytes + a_bytes + M * N * 2, mm


def git_commit():
    if len(sys.argv) > 2 and sys.argv[-1].startswith("commit="):   # the device copy has no .git
        return sys.argv[-1][7:]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def main(out_dir: str, quick: bool = False):
    import cupy as cp
    from powerfusion.ttile.matmul import Matmul
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    dev = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    bw = copy_bandwidth()
    rows = []
    shapes = SHAPES[:2] if quick else SHAPES
    for M in ((1,) if quick else (1, 16, 256)):
        combos = M1_COMBOS if M == 1 else BIG_COMBOS
        for N, K in shapes:
            tc, how, bytes_c = bench_cublas(M, N, K)
            rows.append(dict(M=M, N=N, K=K, kernel="cublas_fp16", A="fp16", W="fp16", time_us=tc * 1e6,
                             timing=how, bytes=bytes_c, frac_copy_bw=bytes_c / tc / bw, speedup=1.0))
            for A, W, zm in combos:
                seen = set()
                natural = Matmul(M, N, K, A, W, group_size=None if W.startswith("mx") else 128, zeros_mode=zm,
                                 out_dtype="fp16" if A == "int8" else A).kind
                for R, ks, kern in variants(M, A, W):
                    try:
                        t, how, nbytes, mm = bench_typed(M, N, K, A, W, zm, R, ks, kern)
                    except Exception as e:   # recorded, never hidden
                        rows.append(dict(M=M, N=N, K=K, kernel=kern or "typed", A=A, W=W, zeros=zm, R=R, ksplit=ks,
                                         error=repr(e)[:300]))
                        continue
                    if (mm.spec.R, mm.spec.ksplit, mm.kind) in seen:
                        continue
                    seen.add((mm.spec.R, mm.spec.ksplit, mm.kind))
                    rows.append(dict(M=M, N=N, K=K, kernel={"gemv": "typed", "mma": "typed-mma"}.get(mm.kind, "dequant+cublas"),
                                     chosen=mm.kind == natural, A=A, W=W,
                                     zeros=zm, R=mm.spec.R, ksplit=mm.spec.ksplit, default=R is None, time_us=t * 1e6, timing=how, bytes=nbytes,
                                     frac_copy_bw=nbytes / t / bw, speedup=tc / t))
                    print(f"M={M} N={N} K={K} {A}x{W}{'/' + zm if zm else ''} {mm.kind} R={mm.spec.R} ks={mm.spec.ksplit}: {t * 1e6:.1f} us "
                          f"({tc / t:.2f}x cuBLAS, {nbytes / t / bw:.0%} of copy BW)", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
            _write(out, dev, bw, rows)   # after every shape, so a time-out keeps what was measured
    _write(out, dev, bw, rows)


def _write(out, dev, bw, rows):
    import cupy as cp
    meta = dict(device=dev, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=git_commit(), copy_bandwidth_GBps=bw / 1e9, cupy=cp.__version__,
                method="CUDA events over CUDA-graph replays, buffers rotated over >256 MiB")
    (out / "ttile_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main(sys.argv[1], "--quick" in sys.argv)
