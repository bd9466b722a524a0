"""cuBLAS `cublasGemmStridedBatchedEx` through ctypes, for Ape's part GEMMs.

The CUDA backend has a binding of its own (backends/cuda/blas.py) made for ONNX MatMul; this
package stands apart from the backends and needs more of the call (leading dimensions of
slices, TF32 and int8 compute types, alpha and beta), so it keeps this small one. Like that
one, it uses the library CuPy loaded, owns its handle and workspace, and binds the handle to a
stream once, so its calls are captured into CUDA graphs like any kernel.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from .reference import ApeError

_NAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so")
OP_N, OP_T = 0, 1
_ALGO_DEFAULT = -1
WORKSPACE_BYTES = 64 << 20


@dataclass(frozen=True)
class GemmType:
    """cudaDataType of A/B and of C, cublasComputeType_t, and the scalar type of alpha/beta."""
    ab: int
    c: int
    compute: int
    scalar: type


# values from cublas_api.h / library_types.h
FP32 = GemmType(0, 0, 68, np.float32)            # CUBLAS_COMPUTE_32F: SGEMM on CUDA cores
TF32 = GemmType(0, 0, 77, np.float32)            # CUBLAS_COMPUTE_32F_FAST_TF32
FP16 = GemmType(2, 0, 68, np.float32)            # fp16 inputs, fp32 accumulate and output
BF16 = GemmType(14, 0, 68, np.float32)
INT8 = GemmType(3, 10, 72, np.int32)             # int8 inputs, CUBLAS_COMPUTE_32I, int32 out
FP64 = GemmType(1, 1, 70, np.float64)


@functools.lru_cache(maxsize=1)
def _lib():
    import cupy  # noqa: F401  (loads cuBLAS through CuPy's bindings first)
    from cupy_backends.cuda.libs import cublas  # noqa: F401
    for name in _NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
            ctypes.c_int, ctypes.c_int, ctypes.c_int]
        return lib
    raise ApeError(f"no cuBLAS library found (tried {', '.join(_NAMES)})")


@dataclass(frozen=True)
class Operand:
    """A row-major matrix view: device pointer, leading dimension (elements), batch stride."""
    ptr: int
    ld: int
    batch_stride: int = 0
    transposed: bool = False   # holds op(X)^T, i.e. (cols x rows) row-major


class Cublas:
    """One handle with its own workspace, bound to one stream at a time."""

    def __init__(self):
        import cupy
        self.lib = _lib()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   WORKSPACE_BYTES), "cublasSetWorkspace")
        self.stream_ptr = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise ApeError(f"{what} failed with cuBLAS status {status}")

    def bind(self, stream) -> None:
        """Queue later calls on `stream` (before a capture begins: binding is not captured)."""
        if stream.ptr != self.stream_ptr:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
            self.stream_ptr = stream.ptr

    def gemm(self, t: GemmType, m: int, n: int, k: int, a: Operand, b: Operand, c: Operand, *,
             alpha=1.0, beta=0.0, batch: int = 1) -> None:
        """Row-major C (m x n, ldc) = alpha A (m x k) B (k x n) + beta C, batched with the
        operands' batch strides. `b.transposed`: B is held as (n x k) row-major."""
        al, be = np.asarray(alpha, t.scalar), np.asarray(beta, t.scalar)
        # row-major C = A B is column-major C^T = B^T A^T: B goes first
        op_b = OP_T if b.transposed else OP_N
        op_a = OP_T if a.transposed else OP_N
        status = self.lib.cublasGemmStridedBatchedEx(
            self.handle, op_b, op_a, n, m, k, ctypes.c_void_p(al.ctypes.data),
            ctypes.c_void_p(b.ptr), t.ab, b.ld, b.batch_stride, ctypes.c_void_p(a.ptr), t.ab, a.ld, a.batch_stride,
            ctypes.c_void_p(be.ctypes.data), ctypes.c_void_p(c.ptr), t.c, c.ld, c.batch_stride,
            batch, t.compute, _ALGO_DEFAULT)
        self._check(status, f"cublasGemmStridedBatchedEx (compute {t.compute}, {m}x{n}x{k}, batch {batch})")


@functools.lru_cache(maxsize=None)
def handle_for(device_id: int) -> Cublas:
    """One handle per device per process."""
    return Cublas()
