"""Library ops on CuPy arrays: MatMul / Gemm through cuBLAS (`cupy.matmul`), Conv as an
im2col kernel of ours followed by one batched cuBLAS matmul.

Why im2col: CuPy 14 no longer ships cuDNN bindings (checked on the lent GPU, see
benchmarks/README.md), so convolution is lowered to GEMM. A 1x1 conv without stride or
padding needs no im2col: its columns are the input itself. The im2col kernel only moves
elements, so it works on raw bits (4- or 2-byte words) and serves fp32, fp16 and bf16
alike; zero padding is all-zero bits in each of them. Grouped convolution is one batched
matmul with the group as a batch dimension.

bfloat16: a bf16 tensor is either a CuPy array of ml_dtypes' bfloat16 (where CuPy accepts
that dtype) or a uint16 array of bf16 bit patterns with `logical_dtype="bfloat16"`. Where
cuBLAS-through-CuPy cannot multiply bf16 (`bf16_matmul_native()` is False) we compute in
fp32 and round back to bf16 (round to nearest even), which is at least as accurate.
"""
from __future__ import annotations

import functools

import numpy as np

from powerfusion.backends.cuda.runtime import compile_source, device_info

_IM2COL_SOURCE = r"""
// cols[n, c, kh, kw, oh, ow] = x[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw] or 0 outside.
extern "C" __global__ void pf_im2col_w{BITS}(
    const {WORD}* __restrict__ x, {WORD}* __restrict__ cols, long long total,
    int H, int W, int KH, int KW, int OH, int OW,
    int sh, int sw, int ph, int pw, int dh, int dw)
{
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        long long t = i;
        int ow = (int)(t % OW); t /= OW;
        int oh = (int)(t % OH); t /= OH;
        int kw = (int)(t % KW); t /= KW;
        int kh = (int)(t % KH); t /= KH;   // t is now n * C + c
        int ih = oh * sh - ph + kh * dh;
        int iw = ow * sw - pw + kw * dw;
        {WORD} v = 0;
        if (ih >= 0 && ih < H && iw >= 0 && iw < W)
            v = x[(t * H + ih) * W + iw];
        cols[i] = v;
    }
}
"""
_WORDS = {4: "unsigned int", 2: "unsigned short", 8: "unsigned long long"}


def _is_bf16(x, logical_dtype) -> bool:
    return logical_dtype == "bfloat16" or getattr(x.dtype, "name", "") == "bfloat16"


@functools.lru_cache(maxsize=1)
def bf16_matmul_native() -> bool:
    """Whether cupy.matmul accepts ml_dtypes.bfloat16 arrays (probed once on the device)."""
    import cupy
    try:
        import ml_dtypes
        a = cupy.asarray(np.ones((4, 4), dtype=ml_dtypes.bfloat16))
        out = cupy.matmul(a, a)
        return bool(float(out.astype(cupy.float32)[0, 0].get()) == 4.0)
    except Exception:
        return False


# bf16 <-> fp32 on the device: one NaN-safe pair, in ttile/runtime.py (the typed GEMMs use it too)
from powerfusion.ttile.runtime import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402


def _to_f32(x, bf16_bits: bool):
    import cupy
    return bf16_bits_to_f32(x) if bf16_bits else x.astype(cupy.float32)


def _from_f32(y, like, bf16_bits: bool):
    return f32_to_bf16_bits(y) if bf16_bits else y.astype(like.dtype)


def matmul(a, b, bias=None, *, trans_a: bool = False, trans_b: bool = False, logical_dtype: str | None = None):
    """numpy-style matmul (batched, broadcasting) with optional transposes of the last two axes;
    `bias` (basic.MatMul.bias): a vector over the last axis added before the one rounding."""
    import cupy
    if bias is not None:
        bits = _is_bf16(a, logical_dtype) and a.dtype == cupy.uint16
        y = matmul(_to_f32(a, bits), _to_f32(b, bits), trans_a=trans_a, trans_b=trans_b)
        return _from_f32(y + _to_f32(bias, bits), a, bits)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs operands of rank >= 2 here, got shapes {a.shape} and {b.shape}")
    if trans_a:
        a = cupy.swapaxes(a, -1, -2)
    if trans_b:
        b = cupy.swapaxes(b, -1, -2)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ, shapes {a.shape} and {b.shape}")
    if not _is_bf16(a, logical_dtype):
        return cupy.matmul(a, b)
    bits = a.dtype == cupy.uint16
    if not bits and bf16_matmul_native():
        return cupy.matmul(a, b)
    # fp32 compute, rounded once at the end
    return _from_f32(cupy.matmul(_to_f32(a, bits), _to_f32(b, bits)), a, bits)


def attention(q, k, v, bias=None, *, scale: float = 1.0, nan_to_zero: bool = False, out_perm=(), out_shape=(),
              logical_dtype: str | None = None):
    """basic.Attention on CuPy arrays, the stand-in where cuDNN does not run it
    (cudnn_attention.py): float32 products and softmax, the probabilities rounded to the
    operands' type before the second product. Allocates (so it is not captured)."""
    import cupy
    bits = _is_bf16(q, logical_dtype) and q.dtype == cupy.uint16   # bf16 held as bit patterns
    qf, kf, vf = (_to_f32(a, bits) for a in (q, k, v))
    s = cupy.matmul(qf, cupy.swapaxes(kf, -1, -2)) * cupy.float32(scale)
    if bias is not None:
        s = s + _to_f32(bias, bits)
    s = cupy.exp(s - s.max(axis=-1, keepdims=True))
    p = s / s.sum(axis=-1, keepdims=True)
    if nan_to_zero:
        p = cupy.where(cupy.isnan(p), cupy.float32(0), p)
    p = _to_f32(_from_f32(p, q, bits), bits)
    y = _from_f32(cupy.matmul(p, vf), q, bits)
    y = cupy.transpose(y, out_perm) if out_perm else y
    return y.reshape(out_shape) if out_shape else y


def gemm(a, b, c=None, *, alpha: float = 1.0, beta: float = 1.0, trans_a: bool = False,
         trans_b: bool = False, logical_dtype: str | None = None):
    """ONNX Gemm: alpha * op(A) @ op(B) + beta * C (C broadcast to the result)."""
    import cupy
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"gemm needs 2-D A and B, got shapes {a.shape} and {b.shape}")
    if alpha == 1.0 and (c is None or beta == 0.0):
        return matmul(a, b, trans_a=trans_a, trans_b=trans_b, logical_dtype=logical_dtype)
    bits = _is_bf16(a, logical_dtype) and a.dtype == cupy.uint16
    low = a.dtype != cupy.float32 and a.dtype != cupy.float64
    # Scale and add in fp32 for low-precision types, so only one rounding happens.
    af = _to_f32(a, bits) if low else a
    bf = _to_f32(b, bits) if low else b
    y = cupy.matmul(af.T if trans_a else af, bf.T if trans_b else bf)
    if alpha != 1.0:
        y *= alpha
    if c is not None and beta != 0.0:
        y += beta * (_to_f32(c, bits) if low else c)
    return _from_f32(y, a, bits) if low else y


@functools.lru_cache(maxsize=None)
def _im2col_kernel(itemsize: int, device: int):
    word = _WORDS.get(itemsize)
    if word is None:
        raise ValueError(f"conv: unsupported element size {itemsize} bytes")
    source = _IM2COL_SOURCE.replace("{WORD}", word).replace("{BITS}", str(itemsize * 8))
    return compile_source(source, name="pf_im2col", device=device).kernel(f"pf_im2col_w{itemsize * 8}")


def _pointwise(kh, kw, sh, sw, ph0, pw0, ph1, pw1) -> bool:
    return kh == kw == sh == sw == 1 and not (ph0 or pw0 or ph1 or pw1)


def _im2col(x, cols, h, wd, kh, kw, oh, ow, sh, sw, ph0, pw0, dh, dw) -> None:
    kernel = _im2col_kernel(x.dtype.itemsize, x.device.id)
    threads = 256
    blocks = max(1, min(-(-cols.size // threads), device_info(x.device.id).sm_count * 32))
    kernel.launch((blocks,), (threads,), (x, cols, np.int64(cols.size), *(np.int32(v) for v in (
        h, wd, kh, kw, oh, ow, sh, sw, ph0, pw0, dh, dw))))


def conv_into(blas, x, w, bias, out, cols: dict, *, strides=None, pads=None, dilations=None, group: int = 1,
              logical_dtype: str | None = None) -> bool:
    """ONNX Conv (2-D) written into `out`, allocating nothing per call: the im2col kernel into
    a columns buffer kept in `cols` (one per shape), then one strided-batched GEMM through
    `blas` (powerfusion.backends.cuda.blas), then the bias in place. Every launch can be
    captured in a CUDA graph. False (and nothing launched) where this path does not apply:
    1-D, bf16 bit patterns with a bias, a batch and groups together, or non-contiguous operands."""
    import cupy
    if x.ndim != 4 or w.ndim != 4 or not x.flags.c_contiguous or not w.flags.c_contiguous:
        return False
    if bias is not None and _is_bf16(x, logical_dtype) and x.dtype == cupy.uint16:
        return False
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    if c != cg * group or m % group or (n > 1 and group > 1):
        return False
    sh, sw = strides or (1, 1)
    ph0, pw0, ph1, pw1 = pads or (0, 0, 0, 0)
    dh, dw = dilations or (1, 1)
    oh = (h + ph0 + ph1 - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + pw0 + pw1 - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0 or out.shape != (n, m, oh, ow) or not out.flags.c_contiguous:
        return False
    if _pointwise(kh, kw, sh, sw, ph0, pw0, ph1, pw1):
        buf = x   # a 1x1 conv without stride or padding: the columns are x itself
    else:
        key = (n, c, kh, kw, oh, ow, x.dtype.str)
        if key not in cols:
            cols[key] = cupy.empty(key[:6], dtype=x.dtype)
        buf = cols[key]
        _im2col(x, buf, h, wd, kh, kw, oh, ow, sh, sw, ph0, pw0, dh, dw)
    ok = blas.gemm_into(w.reshape(1, group, m // group, cg * kh * kw), buf.reshape(n, group, cg * kh * kw, oh * ow),
                        out.reshape(n, group, m // group, oh * ow), logical_dtype=logical_dtype)
    if not ok:
        return False
    if bias is not None:
        out += bias.reshape(1, m, 1, 1).astype(out.dtype, copy=False)
    return True


def channels_last_into(conv_nchw, x, w, out, scratch: dict) -> bool:
    """A channels-last convolution (x [N, *S, C], w [M, *K, C/g], out [N, *S', M];
    frontend/layout.py) through an NCHW route `conv_nchw(x, w, y) -> bool`, on NCHW copies kept
    in `scratch` (one per shape: nothing allocated per call, so it can be captured). The
    fallback where cuDNN, which reads NHWC itself, does not run the conv."""
    import cupy

    def nchw(a, role):
        key = ("channels-last", role, a.shape, a.dtype.str)
        if key not in scratch:
            scratch[key] = cupy.empty((a.shape[0], a.shape[-1], *a.shape[1:-1]), dtype=a.dtype)
        return scratch[key]
    xc, wc, yc = nchw(x, "x"), nchw(w, "w"), nchw(out, "y")
    cupy.copyto(xc, cupy.moveaxis(x, -1, 1))
    cupy.copyto(wc, cupy.moveaxis(w, -1, 1))
    if not conv_nchw(xc, wc, yc):
        return False
    cupy.copyto(out, cupy.moveaxis(yc, 1, -1))
    return True


def conv(x, w, bias=None, *, strides=None, pads=None, dilations=None, group: int = 1,
         logical_dtype: str | None = None):
    """ONNX Conv (NCH / NCHW): x (N, C, *spatial), w (M, C/group, *kernel), pads begin+end."""
    import cupy
    nsp = x.ndim - 2
    if nsp not in (1, 2) or w.ndim != x.ndim:
        raise ValueError(f"conv supports 1-D and 2-D, got x {x.shape} and w {w.shape}")
    if nsp == 1:  # 1-D is 2-D with a height of one
        y = conv(x[:, :, None, :], w[:, :, None, :], bias,
                 strides=(1, *(strides or (1,))), pads=(0, (pads or (0, 0))[0], 0, (pads or (0, 0))[1]),
                 dilations=(1, *(dilations or (1,))), group=group, logical_dtype=logical_dtype)
        return y[:, :, 0, :]
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    sh, sw = strides or (1, 1)
    ph0, pw0, ph1, pw1 = pads or (0, 0, 0, 0)
    dh, dw = dilations or (1, 1)
    if c != cg * group or m % group:
        raise ValueError(f"conv: channels do not match group={group}: x {x.shape}, w {w.shape}")
    oh = (h + ph0 + ph1 - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + pw0 + pw1 - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(f"conv: empty output {oh}x{ow} for x {x.shape}, w {w.shape}")
    x = cupy.ascontiguousarray(x)
    if _pointwise(kh, kw, sh, sw, ph0, pw0, ph1, pw1):
        cols = x   # a 1x1 conv without stride or padding: the columns are x itself
    else:
        cols = cupy.empty((n, c, kh, kw, oh, ow), dtype=x.dtype)
        _im2col(x, cols, h, wd, kh, kw, oh, ow, sh, sw, ph0, pw0, dh, dw)
    # (N, G, Cg*KH*KW, OH*OW) columns times (G, M/G, Cg*KH*KW) weights, batched over N and G
    cols = cols.reshape(n, group, cg * kh * kw, oh * ow)
    wmat = cupy.ascontiguousarray(w).reshape(group, m // group, cg * kh * kw)
    y = matmul(wmat[None], cols, logical_dtype=logical_dtype).reshape(n, m, oh, ow)
    if bias is not None:
        bits = _is_bf16(y, logical_dtype) and y.dtype == cupy.uint16
        if bits:
            y = f32_to_bf16_bits(bf16_bits_to_f32(y) + bf16_bits_to_f32(bias).reshape(1, m, 1, 1))
        else:
            y = y + bias.reshape(1, m, 1, 1).astype(y.dtype)
    return y
