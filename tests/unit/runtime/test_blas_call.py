"""Without a GPU: the arguments `Blas.gemm_into` passes to cublasGemmStridedBatchedEx, run by a
numpy emulation of that call (column-major, strided batches) on host memory, against np.matmul.
The GPU tests (test_blas_gpu.py) run the same shapes through cuBLAS itself. Exact up to float32
summation order: rtol 1e-5."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from powerfusion.backends.cuda.blas import Blas

_OP_N = 0


class HostArray:
    """What gemm_into reads of a CuPy array, over a numpy array."""

    def __init__(self, a: np.ndarray):
        self.a = np.ascontiguousarray(a)
        self.shape, self.ndim, self.dtype = self.a.shape, self.a.ndim, self.a.dtype
        self.flags = SimpleNamespace(c_contiguous=True)
        self.data = SimpleNamespace(ptr=self.a.ctypes.data)


class EmulatedCublas:
    """cublasGemmStridedBatchedEx for float32: C = op(A) op(B) per batch, column-major."""

    def __init__(self):
        self.calls = []

    def cublasGemmStridedBatchedEx(self, handle, op_a, op_b, m, n, k, alpha, a, atype, lda, sa, b, btype, ldb, sb,
                                   beta, c, ctype, ldc, sc, count, compute, algo):
        self.calls.append(dict(m=m, n=n, k=k, count=count))
        for p in range(count):
            left = _matrix(a.value + 4 * p * sa, (m, k), lda, op_a)
            right = _matrix(b.value + 4 * p * sb, (k, n), ldb, op_b)
            out = _column_major(c.value + 4 * p * sc, m, n, ldc)
            out[...] = left @ right
        return 0


def _column_major(ptr: int, rows: int, cols: int, ld: int) -> np.ndarray:
    flat = np.ctypeslib.as_array((ctypes.c_float * (ld * (cols - 1) + rows)).from_address(ptr))
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (4, 4 * ld))


def _matrix(ptr: int, shape: tuple[int, int], ld: int, op: int) -> np.ndarray:
    rows, cols = shape
    return _column_major(ptr, rows, cols, ld) if op == _OP_N else _column_major(ptr, cols, rows, ld).T


def _blas() -> Blas:
    blas = object.__new__(Blas)   # no handle, no device: only the call's arguments matter here
    blas.lib, blas.handle = EmulatedCublas(), ctypes.c_void_p()
    return blas


CASES = [  # a shape, b shape, trans_a, trans_b, GEMM calls' batch count
    ((64, 96), (96, 128), False, False, 1),
    ((96, 64), (96, 128), True, False, 1),
    ((64, 96), (128, 96), False, True, 1),
    ((3, 64, 96), (96, 40), False, False, 1),        # weight shared by the batch: one GEMM of 192 rows
    ((197, 1, 48), (40, 48), False, True, 1),         # ViT's in-projection: 197 one-row products, one GEMM
    ((3, 96, 64), (96, 40), True, False, 3),          # A transposed per batch: stays batched
    ((2, 3, 5, 32), (2, 3, 32, 7), False, False, 6),  # both batched
    ((1, 17, 33), (4, 33, 9), False, False, 4),       # left operand broadcast
]


@pytest.mark.parametrize("sa,sb,ta,tb,count", CASES)
def test_gemm_into_arguments_compute_matmul(sa, sb, ta, tb, count):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    want = np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)
    out = HostArray(np.full(want.shape, np.nan, np.float32))
    blas = _blas()
    assert blas.gemm_into(HostArray(a), HostArray(b), out, trans_a=ta, trans_b=tb)
    np.testing.assert_allclose(out.a, want, rtol=1e-5, atol=1e-5)
    assert [c["count"] for c in blas.lib.calls] == [count]
