"""cuBLAS TF32 GEMM rate by operand layout (device only): does B held K-major ("transposed",
n x k row-major) run faster than B held N-major (k x n row-major, what FP32-T's split writes)?

Hopper's wgmma takes TF32 operands from shared memory K-major only, so an N-major B has to be
handled some other way by cuBLAS. This times, through Ape's own cuBLAS binding and CUDA-graph
replay, the level GEMMs FP32-T runs at a shape: the top level (K) whole and as a strided batch of
K chunks, and the cross level (2K), each with B N-major and K-major.

    PYTHONPATH=$PWD python3 benchmarks/diag/tf32_layouts.py [8192,4096]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import cupy as cp
    from bench_ape import time_graph

    from powerfusion.ape import cublas
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192,4096").split(",")]
    stream = cp.cuda.Stream(non_blocking=True)
    blas = cublas.handle_for(0)
    blas.bind(stream)
    rng = cp.random.default_rng(0)
    print("| size | GEMM | B layout | ms | TFLOP/s |")
    print("|---|---|---|---:|---:|")
    for s in sizes:
        m = n = s
        for label, k, chunk in (("top whole", s, 0), ("top chunks 1024 batched", s, 1024), ("cross 2K", 2 * s, 0)):
            a = rng.standard_normal((m, k), dtype=np.float32)
            b_n = rng.standard_normal((k, n), dtype=np.float32)
            b_k = cp.ascontiguousarray(b_n.T)
            nb = k // chunk if chunk else 1
            kk = chunk or k
            c = cp.empty((nb, m, n), np.float32)
            for layout, b in (("N-major (k x n)", b_n), ("K-major (n x k)", b_k)):
                tr = b is b_k
                a_op = cublas.Operand(a.data.ptr, k, kk if chunk else 0)
                b_op = cublas.Operand(b.data.ptr, k if tr else n, (kk if tr else kk * n) if chunk else 0, transposed=tr)
                c_op = cublas.Operand(c.data.ptr, n, m * n)

                def run(a_op=a_op, b_op=b_op, c_op=c_op, kk=kk, nb=nb, m=m, n=n):
                    blas.gemm(cublas.TF32, m, n, kk, a_op, b_op, c_op, batch=nb)
                t = time_graph(run, stream)
                print(f"| {s} | {label} | {layout} | {t * 1e3:.3f} | {2 * m * n * k / t / 1e12:.0f} |", flush=True)
            del a, b_n, b_k, c
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
