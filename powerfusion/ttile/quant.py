"""Host-side quantisation, dequantisation and bit packing (numpy).

A `QuantizedWeight` holds codes [N, K] (see ttype: unsigned codes, offset binary for
signed ints), group scales [N, G] and zero points [N, G]. Zero-point modes:
  original:  w = (q - z) * s      (z float16)
  rescale:   w = q * s - z        (z float16)
  quantized: w = (q - z) * s      (z an integer code, uint8)
MX block types carry an e8m0 scale (uint8) per 32 elements instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ttype import TType, e8m0_decode, get_ttype

ZERO_MODES = (None, "original", "rescale", "quantized")


@dataclass(frozen=True)
class QuantizedWeight:
    wtype: str
    codes: np.ndarray                 # [N, K] uint codes
    scale: np.ndarray | None          # [N, ceil(K/G)] float16, or uint8 e8m0 for MX types
    zeros: np.ndarray | None          # [N, ceil(K/G)] float16 (original/rescale) or uint8 (quantized)
    group_size: int                   # elements per group along K (K itself: per channel)
    zeros_mode: str | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape


def normalize_group(group_size: int | None, K: int, tt: TType) -> int:
    """Group size in elements: None / -1 mean per channel; MX types force their block."""
    if tt.kind == "block":
        if group_size not in (None, -1, tt.block):
            raise ValueError(f"{tt.name} has a fixed block of {tt.block} elements, not {group_size}")
        return tt.block
    if group_size in (None, -1) or group_size >= K:
        return K
    if group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 32 (32, 64, 128, ...) or per-channel, got {group_size}")
    return int(group_size)


def _check_mode(tt: TType, zeros_mode):
    if zeros_mode not in ZERO_MODES:
        raise ValueError(f"zeros_mode must be one of {ZERO_MODES}, got {zeros_mode!r}")
    if zeros_mode is not None and tt.kind != "uint":
        raise ValueError(f"zero points need an unsigned integer tType, not {tt.name}")


def _groups(w: np.ndarray, G: int) -> np.ndarray:
    """[N, K] -> [N, ngroups, G], the tail group padded with its own last value."""
    N, K = w.shape
    ng = -(-K // G)
    pad = ng * G - K
    if pad:
        w = np.concatenate([w, np.repeat(w[:, -1:], pad, axis=1)], axis=1)
    return w.reshape(N, ng, G)


def _expand(x: np.ndarray, G: int, K: int) -> np.ndarray:
    return np.repeat(x, G, axis=1)[:, :K]


def quantize(weight: np.ndarray, wtype: str, group_size: int | None = 128,
             zeros_mode: str | None = None) -> QuantizedWeight:
    """Float weights [N, K] (output features x input features) -> QuantizedWeight."""
    tt = get_ttype(wtype)
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {w.shape}")
    _check_mode(tt, zeros_mode)
    N, K = w.shape
    G = normalize_group(group_size, K, tt)
    g = _groups(w, G)
    if tt.kind == "block":
        emax = int(np.floor(np.log2(tt.max_value() if not tt.element else get_ttype(tt.element).max_value())))
        amax = np.abs(g).max(-1)
        exp = np.floor(np.log2(np.where(amax > 0, amax, 1.0))).astype(np.int64) - emax
        e8 = np.clip(exp + 127, 0, 254).astype(np.uint8)
        codes = get_ttype(tt.element).encode(g / e8m0_decode(e8)[..., None])
        return QuantizedWeight(wtype, codes.reshape(N, -1)[:, :K], e8, None, G, None)
    if tt.kind in ("float", "table"):
        s = (np.abs(g).max(-1) / tt.max_value()).astype(np.float16)
        s = np.where(s == 0, np.float16(1), s)
        codes = tt.encode(g / s.astype(np.float32)[..., None])
        return QuantizedWeight(wtype, codes.reshape(N, -1)[:, :K], s, None, G, None)
    lo, hi = tt.qrange()
    if zeros_mode is None:
        if tt.signed:
            s = np.abs(g).max(-1) / max(hi, 1)
        else:
            s = np.maximum(g.max(-1), 0) / hi
        s = np.where(s == 0, 1, s).astype(np.float16)
        codes = tt.encode(g / s.astype(np.float32)[..., None])
        return QuantizedWeight(wtype, codes.reshape(N, -1)[:, :K], s, None, G, None)
    mn, mx = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    s = ((mx - mn) / hi)
    s = np.where(s == 0, 1, s).astype(np.float16)
    sf = s.astype(np.float32)[..., None]
    if zeros_mode == "original":
        z = (-mn / s.astype(np.float32)).astype(np.float16)
        q = g / sf + z.astype(np.float32)[..., None]
    elif zeros_mode == "rescale":
        z = (-mn).astype(np.float16)
        q = (g + z.astype(np.float32)[..., None]) / sf
    else:
        z = np.clip(np.rint(-mn / s.astype(np.float32)), 0, hi).astype(np.uint8)
        q = np.rint(g / sf) + z[..., None]
    codes = tt.encode(q)
    return QuantizedWeight(wtype, codes.reshape(N, -1)[:, :K], s, z, G, zeros_mode)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """QuantizedWeight -> float32 [N, K], the plain definition every kernel must match."""
    tt = get_ttype(qw.wtype)
    N, K = qw.codes.shape
    G = qw.group_size
    if tt.kind == "block":
        return get_ttype(tt.element).decode(qw.codes) * _expand(e8m0_decode(qw.scale), G, K)
    s = _expand(qw.scale.astype(np.float32), G, K)
    if qw.zeros_mode is None:
        return tt.decode(qw.codes) * s
    q = qw.codes.astype(np.float32)
    z = _expand(qw.zeros.astype(np.float32), G, K)
    if qw.zeros_mode == "rescale":
        return q * s - z
    return (q - z) * s


def quantize_rows_int8(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8 (MatMulLowBit's act_dtype int8, Int8ActMatmul): (codes, scale
    [rows, 1]) in float64."""
    a = np.asarray(a, np.float64)
    s = np.abs(a).max(axis=-1, keepdims=True) / 127.0
    s = np.where(s == 0, 1.0, s)
    return np.clip(np.rint(a / s), -127, 127), s


# ---- bit packing ----

def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., K] -> uint8 [..., ceil(K*bits/8)], an LSB-first bitstream: no wasted bits
    for any width (int3 packs 8 elements into 3 bytes)."""
    c = np.asarray(codes).astype(np.uint64)
    planes = ((c[..., None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8)
    flat = planes.reshape(*c.shape[:-1], c.shape[-1] * bits)
    return np.packbits(flat, axis=-1, bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, K: int) -> np.ndarray:
    """Inverse of pack_bits."""
    planes = np.unpackbits(np.asarray(packed, np.uint8), axis=-1, bitorder="little")
    planes = planes[..., :K * bits].reshape(*packed.shape[:-1], K, bits).astype(np.uint64)
    out = (planes << np.arange(bits, dtype=np.uint64)).sum(-1)
    return out.astype(np.uint8 if bits <= 8 else np.uint16 if bits <= 16 else np.uint32)


def word_permutation(bits: int, layout: str) -> np.ndarray:
    """perm[slot] = element index inside one 32-bit word of 32/bits elements.

    natural: slot i holds element i.
    pair:    elements 2i and 2i+1 sit 16 bits apart, so one LOP3 with mask 0x000f000f
             (for 4 bits) and the magic 0x6400 exponent yields the half2 (1024+e_2i, 1024+e_2i+1).
    dp4a:    element 4j+b sits in byte b at bit offset j*bits, so (w >> j*bits) & 0x0f0f0f0f
             holds four consecutive elements as bytes, matching four int8 activations.
    """
    E = 32 // bits
    if layout == "natural" or E == 1:
        return np.arange(E)
    slot = np.empty(E, np.int64)                   # slot[element]
    e = np.arange(E)
    if layout == "pair":
        slot = np.where(e % 2 == 0, e // 2, e // 2 + E // 2)
    elif layout == "dp4a":
        S = 8 // bits
        slot = (e % 4) * S + e // 4
    else:
        raise ValueError(f"unknown layout {layout!r}")
    perm = np.empty(E, np.int64)
    perm[slot] = e
    return perm


def pack_words(codes: np.ndarray, bits: int, layout: str) -> np.ndarray:
    """Codes [N, K] (K a multiple of 32/bits) -> uint32 [N, K*bits/32] in `layout`."""
    if 32 % bits:
        raise ValueError(f"word packing needs bits dividing 32, got {bits}; use pack_bits")
    N, K = codes.shape
    E = 32 // bits
    if K % E:
        raise ValueError(f"K={K} is not a multiple of {E} elements per word")
    c = codes.astype(np.uint32).reshape(N, K // E, E)[..., word_permutation(bits, layout)]
    shifts = (np.arange(E, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(c << shifts, axis=-1).astype(np.uint32)


def unpack_words(words: np.ndarray, bits: int, layout: str) -> np.ndarray:
    """Inverse of pack_words: uint32 [N, W] -> codes [N, W*32/bits]."""
    N, W = words.shape
    E = 32 // bits
    shifts = (np.arange(E, dtype=np.uint32) * bits)
    slots = (words[..., None].astype(np.uint32) >> shifts) & np.uint32((1 << bits) - 1 if bits < 32 else 0xFFFFFFFF)
    out = np.empty_like(slots)
    out[..., word_permutation(bits, layout)] = slots
    return out.reshape(N, W * E).astype(np.uint8 if bits <= 8 else np.uint32)


def mma_element_order(bits: int) -> np.ndarray:
    """For the tensor-core kernel: (row, k) of each element in one lane's 16-byte chunk,
    relative to its 8-row tile and 16E-wide K chunk, in word element order.
    Pair p = 2*step + which holds W[g, 16*step + 2t + 8*which + {0, 1}] (the mma B fragment)."""
    E = 32 // bits
    lane = np.arange(32)[:, None, None]
    p = np.arange(2 * E)[None, :, None]
    e = np.arange(2)[None, None, :]
    g, t = lane // 4, lane % 4
    k = 16 * (p // 2) + 2 * t + 8 * (p % 2) + e
    return np.broadcast_to(g, k.shape).reshape(32, 4 * E), k.reshape(32, 4 * E)


def pack_mma(codes: np.ndarray, bits: int, layout: str) -> np.ndarray:
    """Codes [N, K] (N a multiple of 8, K of 16*32/bits) -> uint32 words ordered
    [N/8 tiles][K/(16E) chunks][32 lanes][4 words], each word in `layout`."""
    N, K = codes.shape
    E = 32 // bits
    rows, ks = mma_element_order(bits)
    c = codes.reshape(N // 8, 8, K // (16 * E), 16 * E)
    chunk = c[:, rows, :, ks]                          # [32, 4E, tiles, chunks]
    chunk = chunk.transpose(2, 3, 0, 1).reshape(-1, E)  # words in element order
    return pack_words(chunk, bits, layout).reshape(-1)


def unpack_mma(words: np.ndarray, bits: int, layout: str, N: int, K: int) -> np.ndarray:
    """Inverse of pack_mma."""
    E = 32 // bits
    elems = unpack_words(words.reshape(-1, 1), bits, layout).reshape(N // 8, K // (16 * E), 32, 4 * E)
    rows, ks = mma_element_order(bits)
    out = np.empty((N // 8, 8, K // (16 * E), 16 * E), elems.dtype)
    out[:, rows, :, ks] = elems.transpose(2, 3, 0, 1)
    return out.reshape(N, K)
