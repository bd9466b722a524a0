"""Strided-batched GEMM through cuBLAS's C API (ctypes), for CUDA-graph capture.

CuPy refuses every cuBLAS call while a stream is being captured (its bindings set the
handle's stream on each call, and that raises during capture), so a session that calls
`cupy.matmul` can capture its own kernels only piecewise, with eager cuBLAS calls between
the pieces. This module keeps its own cuBLAS handle, with a workspace of ours (cuBLAS must
not allocate while a graph is captured), binds it to a stream once, and calls
`cublasGemmStridedBatchedEx` directly: those calls are captured like any kernel.

Only what the session's library steps need: row-major operands whose batch is either
contiguous or broadcast (stride 0), fp32 / fp16 / bf16 (raw bits) / fp64, accumulation in
the widest of fp32 and the dtype (no TF32, as `cupy.matmul` by default). `gemm_into` returns
False for anything else, and the caller runs `cupy.matmul` eagerly.

The library is the one CuPy already loaded (same soname), so no second cuBLAS enters the
process.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

_NAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so")
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
# cudaDataType and cublasComputeType_t values from the cuBLAS headers
_TYPES = {"float32": (0, 68, np.float32), "float16": (2, 68, np.float32), "bfloat16": (14, 68, np.float32),
          "float64": (1, 70, np.float64)}
WORKSPACE_BYTES = 32 << 20


class BlasError(RuntimeError):
    pass


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
    return None


def available() -> bool:
    try:
        return _lib() is not None
    except ImportError:
        return False


class Blas:
    """One cuBLAS handle with its own workspace, bound to one stream at a time."""

    def __init__(self):
        import cupy
        lib = _lib()
        if lib is None:
            raise BlasError(f"no cuBLAS library found (tried {', '.join(_NAMES)})")
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self._check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                              WORKSPACE_BYTES), "cublasSetWorkspace")
        self.stream_ptr = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise BlasError(f"{what} failed with cuBLAS status {status}")

    def bind(self, stream) -> None:
        """Queue later calls on `stream` (before a capture begins: binding is not captured)."""
        if stream.ptr != self.stream_ptr:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
            self.stream_ptr = stream.ptr

    def gemm_into(self, a, b, out, *, trans_a: bool = False, trans_b: bool = False,
                  logical_dtype: str | None = None) -> bool:
        """out = op(a) @ op(b), batched over the leading axes (numpy broadcasting where an
        operand's batch is contiguous or entirely broadcast). False when not supported here."""
        dt = logical_dtype or np.dtype(a.dtype).name
        if dt not in _TYPES or a.dtype != b.dtype or out.dtype != a.dtype or a.ndim < 2 or b.ndim < 2:
            return False
        if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
            return False
        M, K = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
        Kb, N = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
        if K != Kb or out.shape[-2:] != (M, N):
            return False
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            return False
        if tuple(out.shape[:-2]) != tuple(batch):
            return False
        count = int(np.prod(batch, dtype=np.int64))
        sa, sb = _batch_stride(a.shape[:-2], batch, M * K), _batch_stride(b.shape[:-2], batch, K * N)
        if sa is None or sb is None:
            return False
        if sb == 0 and sa == M * K and not trans_a and count > 1:
            # B shared by the whole batch: contiguous A and out are one (count*M, K) and one
            # (count*M, N) matrix, so one GEMM. Batched, cuBLAS reads B once per batch and picks
            # GEMV / small-N kernels for few rows (ViT-B/16's projections of (197, 1, 768):
            # 164 us each as 197 GEMVs, ConvNeXt-T's (1, 56, 56, 96) linears: 61 us each).
            M, count, sa = count * M, 1, 0
        ctype, compute, scalar = _TYPES[dt]
        one, zero = np.ones((), scalar), np.zeros((), scalar)
        # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
        op_b, ld_b = (_OP_T, K) if trans_b else (_OP_N, N)
        op_a, ld_a = (_OP_T, M) if trans_a else (_OP_N, K)
        status = self.lib.cublasGemmStridedBatchedEx(
            self.handle, op_b, op_a, N, M, K, ctypes.c_void_p(one.ctypes.data),
            ctypes.c_void_p(b.data.ptr), ctype, ld_b, sb, ctypes.c_void_p(a.data.ptr), ctype, ld_a, sa,
            ctypes.c_void_p(zero.ctypes.data), ctypes.c_void_p(out.data.ptr), ctype, N, M * N,
            count, compute, _GEMM_DEFAULT)
        self._check(status, f"cublasGemmStridedBatchedEx ({dt}, {M}x{N}x{K}, batch {count})")
        return True


def _batch_stride(shape, batch, size: int) -> int | None:
    """An operand's stride over the flattened batch: its matrix size when it has the whole
    batch, 0 when it has none of it (broadcast), None for a partial broadcast."""
    if int(np.prod(shape, dtype=np.int64)) == 1:
        return 0
    if tuple((1,) * (len(batch) - len(shape)) + tuple(shape)) == tuple(batch):
        return size
    return None
