"""numpy model of Ape's GEMMs: `reference_matmul(A, B, mode)` and `block_mask(A, block)`.

The split is bit-faithful to the device kernels (`types.split`). The arithmetic is modelled as
the tensor cores do it in the parts that matter: each part product is exact in fp32 (11 x 11
or 8 x 8 significant bits), and every sum is an fp32 sum. One level of products (e.g. FP32-F's
two cross terms) is one fp32 GEMM over the concatenated K, as on the device, and the levels are
added smallest first. What the model does not reproduce is the order of the fp32 additions
inside a GEMM and the tensor cores' truncating (round-toward-zero) accumulation, so device
results agree with it to a few fp32 ulps of sum(|A||B|), not bit for bit; that difference grows
with K, as SGEMM's own error does.

`order="mma"` models our own tensor-core kernels (`mma.py`) instead: per k-tile of 32, the
tile's part products (all levels; FP32-F's 2^-12-scaled lower levels summed apart and combined
with one rounding) are summed from zero, rounded to fp32 and added to an fp32 accumulator in
round-to-nearest. Sums inside a tile are exact here (float64, then one rounding); the tensor
cores truncate them after every mma instead: a few fp32 ulps of the tile's sum.
"""
from __future__ import annotations

import numpy as np

from powerfusion.errors import PowerFusionError

from .accumulation import TC_STEP, tc_matmul
from .types import FP32_B, FP32_F, TYPES, EmulatedType, split, split_int16

MASK_F, MASK_B, MASK_FP32 = 0, 1, 2
PANEL = 128          # K panel of the mixed plan (a multiple of every GEMM's K tile)


def panel_classes(a_panels: np.ndarray, b_panels: np.ndarray) -> np.ndarray:
    """Class of each K panel: the larger of A's column-panel class and B's row-panel class."""
    return np.maximum(np.asarray(a_panels, np.int8), np.asarray(b_panels, np.int8))


MODES = ("auto", "fp32", "fp32-f", "fp32-t", "fp32-b")
ORDERS = ("levels", "mma")
MMA_K_TILE = 32                                           # K per k-tile (one rounded partial sum)
MMA_K_STEP = {"fp32-f": 16, "fp32-t": 8, "fp32-b": 16}    # K of one mma instruction


class ApeError(PowerFusionError):
    """Bad operands or an unknown mode for an Ape GEMM."""


def element_class(x: np.ndarray) -> np.ndarray:
    """Per element: 0 when FP32-F represents it (zero included), 1 when only FP32-B does,
    2 when neither (Inf, NaN, fp32 subnormals and values near them, |x| >= 2^127)."""
    a = np.abs(np.asarray(x, np.float32)).astype(np.float64)
    cls = np.full(a.shape, MASK_FP32, np.int8)
    in_b = (a >= FP32_B.min_abs) & (a < FP32_B.max_abs)
    in_f = (a >= FP32_F.min_abs) & (a < FP32_F.max_abs)
    cls[in_b] = MASK_B
    cls[in_f | (a == 0)] = MASK_F
    return cls


def block_mask(a: np.ndarray, block) -> np.ndarray:
    """Ape's getMask per block of a 2-D array: the largest element class in each block
    (0 FP32-F, 1 FP32-B, 2 fp32). `block` is an int or (rows, cols); edge blocks are partial."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ApeError(f"block_mask needs a 2-D array, got shape {a.shape}")
    br, bc = (block, block) if np.isscalar(block) else tuple(block)
    if br < 1 or bc < 1:
        raise ApeError(f"block_mask: block sizes must be positive, got {(br, bc)}")
    cls = element_class(a)
    m, k = a.shape
    pad = np.zeros((-(-m // br) * br, -(-k // bc) * bc), np.int8)
    pad[:m, :k] = cls
    return pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc).max(axis=(1, 3))


def _check_operands(a: np.ndarray, b: np.ndarray, mode: str) -> None:
    if mode not in MODES:
        raise ApeError(f"unknown Ape mode {mode!r}; expected one of {', '.join(MODES)}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ApeError(f"Ape matmul needs 2-D operands (M, K) x (K, N), got {a.shape} x {b.shape}")


def _level_gemm(t: EmulatedType, truncate: bool):
    """One GEMM of part products: numpy's fp32 GEMM (round to nearest) or the tensor cores'
    truncating sum (`accumulation.tc_matmul`)."""
    if not truncate:
        return lambda lhs, rhs: (lhs @ rhs).astype(np.float32)
    step = TC_STEP[t.part_dtype]
    return lambda lhs, rhs: tc_matmul(lhs, rhs, step)


def emulated_matmul(a: np.ndarray, b: np.ndarray, t: EmulatedType, k_chunk: int | None = None,
                    truncate: bool = False) -> np.ndarray:
    """C = A B in emulated type `t`: one GEMM per level of part products, added smallest level
    first, each scaled by its level's factor (the cuBLAS engine's order). `k_chunk`: the top
    level (Hi Hi, the only one whose accumulation error reaches C's last bits) runs as GEMMs of
    `k_chunk` columns of K, each added to C in round-to-nearest fp32 (the device's beta = 1).
    `truncate`: every GEMM sums as the tensor cores do (`accumulation`)."""
    pa, pb = split(a, t), split(b, t)
    gemm = _level_gemm(t, truncate)
    c = None
    with np.errstate(over="ignore", invalid="ignore"):
        for index, (level, scale) in reversed(list(enumerate(zip(t.levels, t.level_scale)))):
            lhs = np.concatenate([pa[i] for i, _ in level], axis=1)
            rhs = np.concatenate([pb[j] for _, j in level], axis=0)
            k = lhs.shape[1]
            step = k_chunk if (index == 0 and k_chunk) else max(k, 1)
            for k0 in range(0, max(k, 1), step):
                term = gemm(lhs[:, k0:k0 + step], rhs[k0:k0 + step]) * np.float32(scale)
                c = term if c is None else (term + c).astype(np.float32)
    return c.astype(np.float32)


def mma_matmul(a: np.ndarray, b: np.ndarray, t: EmulatedType) -> np.ndarray:
    """C = A B in emulated type `t` in the mma kernels' order (module docstring): per k-tile,
    the tile's products rounded once (FP32-F: its top level and its 2^-12-scaled lower levels
    apart, then combined) and added to the fp32 accumulator, every addition round-to-nearest."""
    m, k = a.shape
    kp = -(-k // MMA_K_TILE) * MMA_K_TILE
    pa = [np.pad(p, ((0, 0), (0, kp - k))).astype(np.float64) for p in split(a, t)]
    pb = [np.pad(p, ((0, kp - k), (0, 0))).astype(np.float64) for p in split(b, t)]
    lower = [pair for level in t.levels[1:] for pair in level]
    scale = np.float64(t.level_scale[-1])
    acc = np.zeros((m, b.shape[1]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for k0 in range(0, kp, MMA_K_TILE):
            tile = slice(k0, k0 + MMA_K_TILE)
            top = pa[0][:, tile] @ pb[0][tile]
            low = sum(pa[i][:, tile] @ pb[j][tile] for i, j in lower)
            if scale == 1.0:
                part = (top + low).astype(np.float32)
            else:
                part = (top.astype(np.float32).astype(np.float64) + low.astype(np.float32) * scale).astype(np.float32)
            acc = (acc + part).astype(np.float32)
    return acc


def int16_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int16 x int16 -> int32 from four int8 GEMMs (int32 accumulation) and a rank-1
    correction; exact modulo 2^32, so exact wherever the true result fits int32."""
    ah, al = split_int16(a)
    bh, bl = split_int16(b)
    i32 = np.int32
    with np.errstate(over="ignore"):
        hh = ah.astype(i32) @ bh.astype(i32)
        cross = np.concatenate([ah, al], 1).astype(i32) @ np.concatenate([bl, bh], 0).astype(i32)
        ll = al.astype(i32) @ bl.astype(i32)
        return int16_combine(hh, cross, ll, a.astype(np.int64).sum(1), b.astype(np.int64).sum(0), a.shape[1])


def int16_combine(hh, cross, ll, row_sum_a, col_sum_b, k: int) -> np.ndarray:
    """A B = 2^16 HH + 2^8 (HL + LH) + LL + 128 (rowsum A + colsum B) - 2^14 K, in wrapping
    32-bit arithmetic (as the device's combine kernel does it)."""
    u = np.uint32
    rs = (row_sum_a.astype(np.int64) & 0xFFFFFFFF).astype(u)[:, None]
    cs = (col_sum_b.astype(np.int64) & 0xFFFFFFFF).astype(u)[None, :]
    with np.errstate(over="ignore"):
        total = (hh.astype(u) * u(65536) + cross.astype(u) * u(256) + ll.astype(u)
                 + u(128) * (rs + cs) - u((16384 * k) & 0xFFFFFFFF))
    return total.view(np.int32)


def reference_matmul(a: np.ndarray, b: np.ndarray, mode: str = "fp32-f", order: str = "levels", *,
                     k_chunk: int | None = None, truncate: bool = False) -> np.ndarray:
    """The numpy model of `powerfusion.ape.matmul`: fp32 inputs in "fp32-f" / "fp32-t" /
    "fp32-b" / "fp32" (plain fp32 GEMM) / "auto" (K panels of 128 mixed as the adapter's
    mixed plan does: FP32-F where both operands' panels allow it, else FP32-B, else fp32);
    int16 inputs -> int32 (mode ignored). `order`: "levels" models the cuBLAS engine (one GEMM
    per level; `k_chunk`: the top level in chunks of K added in fp32; `truncate`: each GEMM
    sums as the tensor cores do, see `emulated_matmul`), "mma" our own tensor-core kernels
    (`mma_matmul`)."""
    a, b = np.asarray(a), np.asarray(b)
    _check_operands(a, b, mode)
    if order not in ORDERS:
        raise ApeError(f"unknown accumulation order {order!r}; expected one of {', '.join(ORDERS)}")
    if k_chunk is not None and (not isinstance(k_chunk, (int, np.integer)) or k_chunk < 0):
        raise ApeError(f"k_chunk must be a non-negative int (0 or None: one GEMM per level), got {k_chunk!r}")
    if order == "mma" and (k_chunk or truncate):
        raise ApeError("k_chunk and truncate model the cuBLAS engine (order='levels'), not order='mma'")

    def emulated(x, y, t):
        if order == "mma":
            return mma_matmul(x, y, t)
        return emulated_matmul(x, y, t, k_chunk=k_chunk or None, truncate=truncate)
    if a.dtype == np.int16 and b.dtype == np.int16:
        return int16_matmul(a, b)
    if a.dtype != np.float32 or b.dtype != np.float32:
        raise ApeError(f"Ape matmul takes float32 x float32 or int16 x int16, got {a.dtype} x {b.dtype}")
    if mode == "fp32":
        return (a @ b).astype(np.float32)
    if mode != "auto":
        return emulated(a, b, TYPES[mode])
    cls = panel_classes(block_mask(a, (a.shape[0], PANEL))[0], block_mask(b, (PANEL, b.shape[1]))[:, 0])
    c = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for kind, t in ((MASK_FP32, None), (MASK_B, FP32_B), (MASK_F, FP32_F)):
        cols = np.flatnonzero(np.repeat(cls == kind, PANEL)[:a.shape[1]])
        if cols.size:
            with np.errstate(over="ignore", invalid="ignore"):
                part = a[:, cols] @ b[cols] if t is None else emulated(a[:, cols], b[cols], t)
                c = (c + part).astype(np.float32)
    return c
