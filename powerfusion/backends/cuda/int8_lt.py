"""int8 x int8 -> int32 weight GEMMs through cuBLASLt with its own heuristic pick.

`cublasGemmStridedBatchedEx` (int8_gemm.py) picks, on an H200, CUTLASS's Ampere int8 kernels
(`cutlass_80_tensorop_i16832gemm_s8_*`) for BERT-base's weight GEMMs; asked through cuBLASLt's
heuristic, the same library offers its Hopper (sm90) int8 kernels too. This path takes the
case that matters, a constant weight already laid out [N, K] (TN) and an activation whose batch
folds into its rows, on the session's cuBLASLt handle (blaslt.BlasLt: workspace, stream, CUDA
graph capture as for the fp16 bias GEMMs). One descriptor set and algorithm per shape and
pointer alignment, made at the first (eager) call.
"""
from __future__ import annotations

import ctypes

import numpy as np

from powerfusion.backends.cuda.blaslt import WORKSPACE_BYTES, _alignment

_R_8I, _R_32I, _COMPUTE_32I = 3, 10, 72
_DESC_TRANSA = 3


class _Call:
    """Row-major out[m, n] = a[m, k] @ w[n, k]^T: column-major out^T = op_T(w) @ a^T."""

    def __init__(self, lt, m: int, n: int, k: int, aligns: tuple[int, ...]):
        lib = lt.lib
        self.desc = ctypes.c_void_p()
        lt.check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32I, _R_32I), "MatmulDescCreate")
        lt.set_attr(self.desc, _DESC_TRANSA, ctypes.c_int32(1))
        self.w, self.a, self.c = lt.layout(_R_8I, k, n, k), lt.layout(_R_8I, k, m, k), lt.layout(_R_32I, n, m, n)
        self.algo = lt.heuristic(self.desc, self.w, self.a, self.c, aligns, f"int8 {m}x{n}x{k}")


class Int8Lt:
    """The int8 weight GEMMs of one session on a cuBLASLt handle (blaslt.BlasLt)."""

    def __init__(self, lt):
        self.lt = lt
        self.one, self.zero = np.ones((), np.int32), np.zeros((), np.int32)
        self._calls: dict[tuple, _Call] = {}

    @staticmethod
    def shape(a, w, out) -> tuple[int, int, int] | None:
        """(M, N, K) where out = a @ w^T with a's batch folded into its rows, else None."""
        if w.ndim != 2 or a.ndim < 2 or not (a.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous):
            return None
        n, k = w.shape
        m = int(np.prod(a.shape[:-1], dtype=np.int64))
        if a.shape[-1] != k or out.size != m * n or out.shape[-1] != n:
            return None
        return m, int(n), int(k)

    def gemm_into(self, a, w, out, stream_ptr: int) -> int:
        """out = a @ w^T (int32); the cuBLAS status (0: done). Raises BlasLtError where cuBLASLt
        has no algorithm for the shape."""
        m, n, k = self.shape(a, w, out)
        aligns = tuple(_alignment(p) for p in (w.data.ptr, a.data.ptr, out.data.ptr, out.data.ptr))
        key = (m, n, k, aligns)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call(self.lt, m, n, k, aligns)
        return self.lt.lib.cublasLtMatmul(
            self.lt.handle, call.desc, self.one.ctypes.data, w.data.ptr, call.w, a.data.ptr, call.a,
            self.zero.ctypes.data, out.data.ptr, call.c, out.data.ptr, call.c, ctypes.byref(call.algo),
            self.lt.workspace.data.ptr, WORKSPACE_BYTES, stream_ptr)
