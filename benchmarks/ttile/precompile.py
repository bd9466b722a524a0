"""Compile every kernel the GPU tests and the benchmark need, in parallel processes,
so CuPy's on-disk cache is warm before the (single-process) test and benchmark runs."""
from __future__ import annotations

import multiprocessing as mp
import sys
import time


def _sources():
    if "--prefill" in sys.argv:   # only the prefill kernel's tests and benchmark
        from tests.ttile.gpu_cases import prefill_matmuls
        from benchmarks.ttile import bench_prefill
        seen = {}
        for mm in list(prefill_matmuls()) + list(bench_prefill.all_matmuls("--quick" in sys.argv)):
            seen[mm.name + str(hash(mm.source))] = (mm.source, mm.name)
        return list(seen.values())
    from tests.ttile.gpu_cases import gpu_matmuls, path_matmuls, tiling_matmuls, unaligned_matmuls
    from tests.ttile.onnx_models import session_matmuls
    from benchmarks.ttile import bench
    seen = {}
    for mm in (list(gpu_matmuls()) + list(tiling_matmuls()) + list(path_matmuls()) + list(unaligned_matmuls())
               + list(session_matmuls())):
        seen[mm.name + str(hash(mm.source))] = (mm.source, mm.name)
    if "--bench" in sys.argv:
        for mm in bench.all_matmuls("--quick" in sys.argv, "--m1-only" in sys.argv):
            seen[mm.name + str(hash(mm.source))] = (mm.source, mm.name)
    return list(seen.values())


def _compile(item):
    from powerfusion.ttile.runtime import compile_kernel
    src, name = item
    try:
        compile_kernel(src, name)
        return None
    except Exception as e:
        return f"{name}: {e}"[:2000]


if __name__ == "__main__":
    t0 = time.time()
    items = _sources()
    with mp.get_context("spawn").Pool(16) as pool:
        errs = [e for e in pool.map(_compile, items, chunksize=2) if e]
    print(f"compiled {len(items)} kernels in {time.time() - t0:.1f}s, {len(errs)} failed")
    for e in errs[:5]:
        print(e)
