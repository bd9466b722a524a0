"""Compile every kernel the GPU tests and the benchmark need, in parallel processes,
so CuPy's on-disk cache is warm before the (single-process) test and benchmark runs."""
from __future__ import annotations

import multiprocessing as mp
import sys
import time


def _sources():
    from powerfusion.ttile.matmul import Matmul
    from tests.ttile.gpu_cases import gpu_matmuls, path_matmuls, tiling_matmuls, unaligned_matmuls
    from tests.ttile.onnx_models import session_matmuls
    from benchmarks.ttile import bench
    seen = {}
    for mm in (list(gpu_matmuls()) + list(tiling_matmuls()) + list(path_matmuls()) + list(unaligned_matmuls())
               + list(session_matmuls())):
        seen[mm.name + str(hash(mm.source))] = (mm.source, mm.name)
    if "--bench" in sys.argv:
        quick = "--quick" in sys.argv
        for M in ((1,) if quick else (1, 16, 256)):
            combos = bench.M1_COMBOS if M == 1 else bench.BIG_COMBOS
            for N, K in (bench.SHAPES[:2] if quick else bench.SHAPES):
                for A, W, zm in combos:
                    for R, ks, kern in bench.variants(M, A, W):
                        mm = Matmul(M, N, K, A, W, group_size=None if W.startswith("mx") else 128,
                                    zeros_mode=zm, out_dtype="fp16" if A == "int8" else A, rows_per_warp=R,
                                    ksplit=ks, kernel=kern)
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
