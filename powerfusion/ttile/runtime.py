"""Compiling and launching typed-GEMM kernels through CuPy (imported lazily)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def compile_kernel(source: str, name: str):
    """NVRTC via cupy.RawModule (CuPy keeps an on-disk cache keyed by source, options and
    arch); nvcc if NVRTC cannot find the fp16/bf16 headers.
    Seam: switch to powerfusion.runtime.cache once it exposes a cubin loader for CuPy."""
    import os

    import cupy as cp
    opts = ["-std=c++17"]
    cuda = cp.cuda.get_cuda_path()
    if cuda and os.path.isdir(os.path.join(cuda, "include")):
        opts.append("-I" + os.path.join(cuda, "include"))
    try:
        return cp.RawModule(code=source, options=tuple(opts)).get_function(name)
    except cp.cuda.compiler.CompileException as e:
        if "cuda_fp16.h" not in str(e) and "cuda_bf16.h" not in str(e):
            raise
        return cp.RawModule(code=source, options=("-std=c++17",), backend="nvcc").get_function(name)


def bf16_bits_to_f32(x):
    """uint16 array of bf16 bits -> float32 (exact)."""
    import cupy as cp
    return (x.astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bf16_bits(x):
    """float32 -> uint16 bf16 bits, round to nearest even (finite inputs)."""
    import cupy as cp
    u = x.astype(cp.float32).view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
