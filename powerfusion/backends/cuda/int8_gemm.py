"""int8 x int8 -> int32 GEMMs on integer tensor cores (IMMA) through cuBLAS.

Quantised MatMuls reach the session as MatMul steps with int8 operands and an int32 result
(zero points folded into memory-bound terms at import: precision/integer_gemm.py). They run as
`cublasGemmStridedBatchedEx` with CUDA_R_8I inputs, a CUDA_R_32I output and CUBLAS_COMPUTE_32I,
on the session's own cuBLAS handle (blas.Blas), so they are captured in its CUDA graph.

cuBLAS's IMMA kernels need K and every leading dimension a multiple of 4 (4-byte rows of int8).
Both operands are laid out with K contiguous, the "TN" layout (column-major op(A) = A^T,
op(B) = B; in our row-major terms the weight transposed, trans_b) that cuBLASLt's low-precision
tensor-core kernels are built around (its fp8 GEMMs accept nothing else): a constant weight
given as [K, N] is transposed once, at the first (eager) run, and multiplied as [N, K]; the
convolution writes its columns as [positions, K]. (Measured with the weight as given, the int8
BERT layers ran 6x slower than fp16; whether the layout is the cause is not yet measured.)
Other shapes, and any call cuBLAS refuses, take the fallback: the operands widened to float64
in buffers of ours (allocated at the first, eager run; kept per step) and a float64 cuBLAS GEMM,
exact for any K below 2**37 / 128**2. `routes` says which path each step took and why.

Weight GEMMs (a constant [N, K] weight, the activation's batch folded into its rows) go
through cuBLASLt's own heuristic instead (int8_lt.py: on an H200 cublasGemmStridedBatchedEx
picks Ampere CUTLASS int8 kernels, cuBLASLt's heuristic may offer Hopper ones), route "imma-lt",
where its first (eager) result equals the cublasGemmEx one bit for bit (int32 sums are exact, so
any difference is a fault, and the step then keeps "imma"). `USE_LT = False` turns this off
(benchmarks compare both). The requantisation stays in the memory-bound kernels, where it fuses
with the neighbouring elementwise ops.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I = 3, 10, 72
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
USE_LT = True       # weight GEMMs through cuBLASLt's heuristic where it agrees (int8_lt.py)


def is_int8_gemm(a, b, out) -> bool:
    """Whether these are the operands of an int8 x int8 -> int32 GEMM."""
    return a.dtype == np.int8 and b.dtype == np.int8 and out.dtype == np.int32


def imma_blocker(m: int, n: int, k: int, trans_a: bool, trans_b: bool) -> str | None:
    """Why IMMA cannot run this row-major GEMM (a [m, k], b [k, n]), or None."""
    lda, ldb = (m if trans_a else k), (k if trans_b else n)
    bad = [f"{name}={v}" for name, v in (("K", k), ("lda", lda), ("ldb", ldb), ("ldc", n)) if v % 4]
    return f"not a multiple of 4: {', '.join(bad)}" if bad else None


class Int8Gemm:
    """The int8 GEMMs of one session on its cuBLAS handle (a blas.Blas)."""

    def __init__(self, blas, lt=None):
        self.blas = blas
        self.lt = lt            # an int8_lt.Int8Lt, or None
        # step name -> "imma" (cuBLAS took the int8 call) or "fallback float64: <why>"
        self.routes: dict[str, str] = {}
        self._wide: dict[str, tuple] = {}    # step name -> its float64 buffers
        self._weights: dict[str, tuple] = {}   # step name -> (pointer of the weight, its transpose)

    def gemm_into(self, name: str, a, b, out, *, trans_a: bool = False, trans_b: bool = False,
                  b_constant: bool = False) -> bool:
        """out = op(a) @ op(b) (int32, exact), batched as blas.gemm_into; False where neither path
        applies. `b_constant`: b never changes (a model weight), so a [K, N] one is transposed
        once and kept, and the GEMM runs in cuBLAS's int8 TN layout."""
        from powerfusion.backends.cuda.blas import _batch_stride
        if not is_int8_gemm(a, b, out) or a.ndim < 2 or b.ndim < 2:
            return False
        if b_constant and not trans_b and b.ndim == 2 and b.flags.c_contiguous:
            b, trans_b = self._transposed(name, b), True
        if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
            return False
        m, k = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
        kb, n = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            return False
        if k != kb or tuple(out.shape) != tuple(batch) + (m, n):
            return False
        sa, sb = _batch_stride(a.shape[:-2], batch, m * k), _batch_stride(b.shape[:-2], batch, k * n)
        if sa is None or sb is None:
            return False
        route = self.routes.get(name)
        if route is None:
            route = self.routes[name] = self._first_route(a, b, out, m, n, k, trans_a, trans_b)
            if route == "imma" and b_constant and trans_b and not trans_a:
                route = self.routes[name] = self._lt_route(a, b, out)
        if route == "imma-lt":
            self.blas._check(self.lt.gemm_into(a, b, out, self.blas.stream_ptr), f"cublasLtMatmul (int8, {m}x{n}x{k})")
            return True
        if route == "imma":
            status = self._imma(a, b, out, m, n, k, sa, sb, int(np.prod(batch, dtype=np.int64)), trans_a, trans_b)
            self.blas._check(status, f"cublasGemmStridedBatchedEx (int8, {m}x{n}x{k})")
            return True
        return self._fallback(name, a, b, out, trans_a, trans_b)

    def _transposed(self, name: str, b):
        """b^T, contiguous, made at the first (eager) run and reused while b stays where it is."""
        import cupy
        kept = self._weights.get(name)
        if kept is None or kept[0] != b.data.ptr:
            kept = self._weights[name] = (b.data.ptr, cupy.ascontiguousarray(b.T))
        return kept[1]

    def _first_route(self, a, b, out, m, n, k, trans_a, trans_b) -> str:
        """IMMA where the shape allows it and cuBLAS accepts the call (tried once, eagerly)."""
        from powerfusion.backends.cuda.blas import _batch_stride
        why = imma_blocker(m, n, k, trans_a, trans_b)
        if why is None and any(x.data.ptr % 4 for x in (a, b, out)):
            why = "an operand is not 4-byte aligned"
        if why is not None:
            return f"fallback float64: {why}"
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        status = self._imma(a, b, out, m, n, k, _batch_stride(a.shape[:-2], batch, m * k),
                            _batch_stride(b.shape[:-2], batch, k * n), int(np.prod(batch, dtype=np.int64)),
                            trans_a, trans_b)
        return "imma" if status == 0 else f"fallback float64: cuBLAS refused int8 (status {status})"

    def _lt_route(self, a, b, out) -> str:
        """ "imma-lt" where cuBLASLt takes out = a @ b^T and its result equals the cublasGemmEx
        one just written to `out` (first, eager run), else "imma"."""
        from powerfusion.backends.cuda.blaslt import BlasLtError
        if not USE_LT or self.lt is None or self.lt.shape(a, b, out) is None:
            return "imma"
        import cupy
        want = out.copy()
        try:
            status = self.lt.gemm_into(a, b, out, self.blas.stream_ptr)
        except BlasLtError:
            status = -1
        same = status == 0 and bool(cupy.array_equal(out, want))
        out[...] = want
        return "imma-lt" if same else "imma"

    def _imma(self, a, b, out, m, n, k, sa, sb, count, trans_a, trans_b) -> int:
        one, zero = np.ones((), np.int32), np.zeros((), np.int32)
        # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
        op_b, ld_b = (_OP_T, k) if trans_b else (_OP_N, n)
        op_a, ld_a = (_OP_T, m) if trans_a else (_OP_N, k)
        return self.blas.lib.cublasGemmStridedBatchedEx(
            self.blas.handle, op_b, op_a, n, m, k, ctypes.c_void_p(one.ctypes.data),
            ctypes.c_void_p(b.data.ptr), CUDA_R_8I, ld_b, sb, ctypes.c_void_p(a.data.ptr), CUDA_R_8I, ld_a, sa,
            ctypes.c_void_p(zero.ctypes.data), ctypes.c_void_p(out.data.ptr), CUDA_R_32I, n, m * n,
            count, CUBLAS_COMPUTE_32I, _GEMM_DEFAULT)

    def _fallback(self, name: str, a, b, out, trans_a, trans_b) -> bool:
        import cupy
        if name not in self._wide:   # the first (eager) run allocates; captured runs reuse
            self._wide[name] = tuple(cupy.empty(x.shape, cupy.float64) for x in (a, b, out))
        a64, b64, c64 = self._wide[name]
        a64[...] = a
        b64[...] = b
        if not self.blas.gemm_into(a64, b64, c64, trans_a=trans_a, trans_b=trans_b):
            return False
        cupy.rint(c64, out=c64)
        out[...] = c64
        return True


# ---- int8 convolution: im2col into 4-aligned columns, then the GEMM above ------------------

_IM2COL_INT8 = r"""
// cols[n, p, k] (ldp rows of ldk, k = (c*KH + kh)*KW + kw, p = oh*OW + ow) = x[n, c, ih, iw] or 0
extern "C" __global__ void pf_im2col_i8(
    const signed char* __restrict__ x, signed char* __restrict__ cols, long long total,
    int C, int H, int W, int KH, int KW, int OH, int OW, int ldk, int ldp,
    int sh, int sw, int ph, int pw, int dh, int dw)
{
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        long long t = i;
        int ow = (int)(t % OW); t /= OW;
        int oh = (int)(t % OH); t /= OH;
        int kw = (int)(t % KW); t /= KW;
        int kh = (int)(t % KH); t /= KH;
        int c = (int)(t % C);   long long n = t / C;
        int ih = oh * sh - ph + kh * dh, iw = ow * sw - pw + kw * dw;
        signed char v = 0;
        if (ih >= 0 && ih < H && iw >= 0 && iw < W)
            v = x[((n * C + c) * H + ih) * W + iw];
        cols[(n * ldp + oh * OW + ow) * (long long)ldk + (c * KH + kh) * KW + kw] = v;
    }
}
"""


@functools.lru_cache(maxsize=None)
def _im2col_kernel(device: int):
    from powerfusion.backends.cuda.runtime import compile_source
    return compile_source(_IM2COL_INT8, name="pf_im2col_i8", device=device).kernel("pf_im2col_i8")


def _round4(v: int) -> int:
    return -(-v // 4) * 4


class Int8Conv:
    """2-D int8 x int8 -> int32 convolutions of one group on the session's Int8Gemm: the columns
    are written as [positions, K] (the TN layout), both padded to multiples of 4 (zeros that are
    never overwritten), so IMMA applies to every shape; the weight is copied into a K-padded
    buffer each run (M x K bytes) and the padded output copied into the step's buffer."""

    def __init__(self, gemm: Int8Gemm):
        self.gemm = gemm
        self._bufs: dict[str, tuple] = {}    # step name -> (cols, padded weight, padded output)

    def conv_into(self, name: str, x, w, out, *, strides, pads, dilations, group: int) -> bool:
        """out = conv(x, w) (int32, exact, zero padding); False where this path does not apply."""
        if x.dtype != np.int8 or w.dtype != np.int8 or out.dtype != np.int32 or x.ndim != 4 or w.ndim != 4:
            return False
        if group != 1 or not (x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous):
            return False
        n, c, h, wd = x.shape
        m, cw, kh, kw = w.shape
        (sh, sw), (ph0, pw0, ph1, pw1), (dh, dw) = strides or (1, 1), pads or (0, 0, 0, 0), dilations or (1, 1)
        oh = (h + ph0 + ph1 - dh * (kh - 1) - 1) // sh + 1
        ow = (wd + pw0 + pw1 - dw * (kw - 1) - 1) // sw + 1
        if cw != c or oh <= 0 or ow <= 0 or out.shape != (n, m, oh, ow):
            return False
        k, p = c * kh * kw, oh * ow
        cols, wp, op = self._buffers(name, n, m, k, p)
        wp[:, :k] = w.reshape(m, k)
        self._im2col(x, cols, (c, h, wd, kh, kw, oh, ow), (sh, sw, ph0, pw0, dh, dw))
        target = out.reshape(n, m, p) if op is None else op
        if not self.gemm.gemm_into(name, wp[None], cols, target, trans_b=True):
            return False
        if op is not None:
            out.reshape(n, m, p)[...] = op[:, :, :p]
        return True

    def _buffers(self, name, n, m, k, p):
        import cupy
        if name not in self._bufs:    # the first (eager) run allocates; captured runs reuse
            kp, pp = _round4(k), _round4(p)
            self._bufs[name] = (cupy.zeros((n, pp, kp), cupy.int8), cupy.zeros((m, kp), cupy.int8),
                                None if pp == p else cupy.zeros((n, m, pp), cupy.int32))
        return self._bufs[name]

    def _im2col(self, x, cols, dims, geometry) -> None:
        from powerfusion.backends.cuda.runtime import device_info
        kernel = _im2col_kernel(x.device.id)
        c, h, wd, kh, kw, oh, ow = dims
        total = x.shape[0] * c * kh * kw * oh * ow
        threads = 256
        blocks = max(1, min(-(-total // threads), device_info(x.device.id).sm_count * 32))
        kernel.launch((blocks,), (threads,), (x, cols, np.int64(total), *(np.int32(v) for v in (
            c, h, wd, kh, kw, oh, ow, cols.shape[2], cols.shape[1], *geometry))))
