"""Compiling and launching typed-GEMM kernels through CuPy (imported lazily)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def compile_kernel(source: str, name: str):
    """NVRTC via cupy.RawModule (CuPy keeps an on-disk cache keyed by source, options and
    arch); nvcc if NVRTC cannot find the fp16/bf16 headers.
    Seam: powerfusion.runtime.cache.KernelCache().get_or_build({source hash, arch, nvrtc
    version}, build=<cubin bytes>) + cupy.cuda.function.Module().load(cubin) replaces this."""
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


# CuPy arrays have no bfloat16 dtype we can rely on (backends/cuda/library.py probes it), so the
# device keeps bf16 as uint16 bits and these two convert on the GPU (NaN stays NaN; the copy that
# lived here before turned NaN into Inf); on the host bf16 is ml_dtypes.bfloat16 throughout.
def bf16_bits_to_f32(bits):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    import cupy
    return (bits.astype(cupy.uint32) << 16).view(cupy.float32)


def f32_to_bf16_bits(x):
    """float32 -> uint16 bf16 bit patterns, round to nearest even; NaN stays a quiet NaN."""
    import cupy
    u = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(cupy.uint16)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return cupy.where(is_nan, ((u >> 16) | 0x0040).astype(cupy.uint16), rounded)


# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
_CUDA_R = {"fp16": 2, "bf16": 14, "fp32": 0}
_OP_N, _OP_T, _COMPUTE_32F, _GEMM_DEFAULT = 0, 1, 68, -1


def gemm_nt_f32(A, W, dtype: str, out=None):
    """C[M, N] (fp32) = A[M, K] . W[N, K]^T for fp16 / bf16 operands through cublasGemmEx:
    tensor cores, fp32 accumulation (CuPy's matmul has no bf16). CuPy's wrapper runs it on the
    current stream and refuses stream capture. `out`: a preallocated [M, N] fp32 array."""
    import cupy as cp
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    M, K = A.shape
    N = W.shape[0]
    A, W = cp.ascontiguousarray(A), cp.ascontiguousarray(W)
    C = out if out is not None else cp.empty((M, N), cp.float32)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    t = _CUDA_R[dtype]
    # row-major C = A W^T is column-major C^T = W^T(op T of W's [K, N] view) x A^T
    cublas.gemmEx(cp.cuda.device.get_cublas_handle(), _OP_T, _OP_N, N, M, K, one.ctypes.data,
                  W.data.ptr, t, K, A.data.ptr, t, K, zero.ctypes.data, C.data.ptr, _CUDA_R["fp32"], N,
                  _COMPUTE_32F, _GEMM_DEFAULT)
    return C
