"""GEMMs with a bias epilogue through cuBLASLt's C API (ctypes), for CUDA-graph capture.

`MatMul(bias=True)` (frontend/gemm_bias.py) is out = op(A) @ op(B) + bias, the bias a vector over
the result's columns, added in fp32 before the one rounding to the result's type: cuBLASLt's
CUBLASLT_EPILOGUE_BIAS, the call torch.compile makes for a Linear with a bias. As in blas.py,
the calls are made directly (CuPy's bindings refuse cuBLAS during capture), with a workspace of
ours, on the stream given, so they are captured like any kernel.

What runs here: fp32 / fp16 / bf16 (raw bits), fp32 accumulation (no TF32), B two-dimensional
(a weight), A contiguous with its batch folded into its rows (not transposed then). `gemm_bias_into`
returns False for anything else, and the session falls back to a GEMM and a separate add
(reported in `fallbacks`). One descriptor set and one heuristic pick per shape, dtype, pointer
alignment and bias pointer, made at the first (eager) call.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

_NAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so")
_OP_N, _OP_T = 0, 1
_COMPUTE_32F, _SCALE_32F = 68, 0
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_BIAS_TYPE = 3, 4, 7, 8, 26
_EPILOGUE_BIAS = 4
_PREF_WORKSPACE, _PREF_ALIGN = 1, (5, 6, 7, 8)   # MAX_WORKSPACE_BYTES, MIN_ALIGNMENT_{A,B,C,D}_BYTES
_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class BlasLtError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _lib():
    import cupy  # noqa: F401  (loads cuBLAS, and with it cuBLASLt, through CuPy first)
    from cupy_backends.cuda.libs import cublas  # noqa: F401
    for name in _NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64,
                                                   ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                       ctypes.POINTER(_Heuristic), ctypes.POINTER(ctypes.c_int)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                       ctypes.POINTER(_Algo), vp, sz, vp]
        return lib
    return None


def available() -> bool:
    try:
        return _lib() is not None
    except ImportError:
        return False


class _Call:
    """One shape's descriptors and algorithm (kept alive with the handle)."""

    def __init__(self, lt: BlasLt, dtype: int, m: int, n: int, k: int, trans_a: bool, trans_b: bool,
                 bias_ptr: int, aligns: tuple[int, ...]):
        lib = lt.lib
        self.desc = ctypes.c_void_p()
        lt.check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _SCALE_32F), "MatmulDescCreate")
        # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's "A" is our B
        for attr, value in ((_DESC_TRANSA, _OP_T if trans_b else _OP_N), (_DESC_TRANSB, _OP_T if trans_a else _OP_N),
                            (_DESC_EPILOGUE, _EPILOGUE_BIAS), (_DESC_BIAS_TYPE, dtype)):
            lt.set_attr(self.desc, attr, ctypes.c_int32(value))
        self.bias = ctypes.c_void_p(bias_ptr)
        lt.set_attr(self.desc, _DESC_BIAS_POINTER, self.bias)
        self.a = lt.layout(dtype, *((k, n, k) if trans_b else (n, k, n)))
        self.b = lt.layout(dtype, *((m, k, m) if trans_a else (k, m, k)))
        self.c = lt.layout(dtype, n, m, n)
        self.algo = lt.heuristic(self.desc, self.a, self.b, self.c, aligns, f"bias-epilogue {m}x{n}x{k}")


class BlasLt:
    """One cuBLASLt handle with its own workspace."""

    def __init__(self):
        import cupy
        lib = _lib()
        if lib is None:
            raise BlasLtError(f"no cuBLASLt library found (tried {', '.join(_NAMES)})")
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self.check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self.one, self.zero = np.ones((), np.float32), np.zeros((), np.float32)
        self._calls: dict[tuple, _Call] = {}

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise BlasLtError(f"cublasLt{what} failed with cuBLAS status {status}")

    def set_attr(self, desc, attr: int, value) -> None:
        self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "MatmulDescSetAttribute")

    def layout(self, dtype: int, rows: int, cols: int, ld: int):
        out = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, rows, cols, ld), "MatrixLayoutCreate")
        return out

    def heuristic(self, desc, a, b, c, aligns: tuple[int, ...], what: str) -> _Algo:
        """cuBLASLt's first algorithm for D = op(A) op(B) with C = D, our workspace, and the
        pointers' alignments (A, B, C, D); BlasLtError where it has none."""
        lib, pref = self.lib, ctypes.c_void_p()
        self.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        self.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_WORKSPACE, ctypes.byref(
            ctypes.c_uint64(WORKSPACE_BYTES)), 8), "MatmulPreferenceSetAttribute")
        for attr, align in zip(_PREF_ALIGN, aligns):
            self.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(ctypes.c_uint32(align)), 4),
                       "MatmulPreferenceSetAttribute")
        found, count = _Heuristic(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, 1, ctypes.byref(found),
                                                    ctypes.byref(count))
        if status != 0 or count.value < 1:
            raise BlasLtError(f"no cuBLASLt {what} algorithm (status {status})")
        return found.algo

    def gemm_bias_into(self, a, b, bias, out, stream_ptr: int, *, trans_a: bool = False, trans_b: bool = False,
                       logical_dtype: str | None = None) -> bool:
        """out = op(a) @ op(b) + bias on `stream_ptr`; False where this path does not apply."""
        dt = logical_dtype or np.dtype(a.dtype).name
        shape = _gemm_shape(a, b, bias, out, trans_a, trans_b)
        if dt not in _TYPES or shape is None or len({a.dtype, b.dtype, bias.dtype, out.dtype}) != 1:
            return False
        m, n, k = shape
        ptrs = (b.data.ptr, a.data.ptr, out.data.ptr, out.data.ptr)
        aligns = tuple(_alignment(p) for p in ptrs)
        key = (dt, m, n, k, trans_a, trans_b, aligns, bias.data.ptr)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call(self, _TYPES[dt], m, n, k, trans_a, trans_b, bias.data.ptr, aligns)
        status = self.lib.cublasLtMatmul(
            self.handle, call.desc, self.one.ctypes.data, b.data.ptr, call.a, a.data.ptr, call.b,
            self.zero.ctypes.data, out.data.ptr, call.c, out.data.ptr, call.c, ctypes.byref(call.algo),
            self.workspace.data.ptr, WORKSPACE_BYTES, stream_ptr)
        self.check(status, f"Matmul ({dt}, {m}x{n}x{k}, bias)")
        return True


def _gemm_shape(a, b, bias, out, trans_a: bool, trans_b: bool) -> tuple[int, int, int] | None:
    """(M, N, K) of the row-major GEMM, A's batch folded into its rows; None where unsupported."""
    if b.ndim != 2 or a.ndim < 2 or bias.ndim != 1 or (trans_a and a.ndim != 2):
        return None
    if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous and bias.flags.c_contiguous):
        return None
    k, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    m = a.shape[-1] if trans_a else int(np.prod(a.shape[:-1], dtype=np.int64))
    ka = a.shape[-2] if trans_a else a.shape[-1]
    if ka != k or bias.shape[0] != n or out.size != m * n or out.shape[-1] != n:
        return None
    return int(m), int(n), int(k)


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 dividing `ptr` (cuBLASLt may assume 256 otherwise)."""
    align = 256
    while align > 1 and ptr % align:
        align //= 2
    return align
