"""The emulated types (Ape, section 4): how one fp32 (or int16) splits into low-bitwidth parts,
which part products a GEMM forms, and the input range each type represents.

The splits here are the numpy model of the device split kernels (`kernels.py`) and agree with
them bit for bit: fp16 / bf16 conversions round to nearest even (numpy / ml_dtypes and PTX
`cvt.rn`), TF32 rounding is done on the bits in both. A non-finite x keeps x in its first part
and zeros in the others (so NaN stays NaN; Inf does not survive a cross product with a zero
part, which is why the adapter sends blocks with Inf or NaN to fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

F_SCALE = np.float32(4096.0)  # FP32-F stores its low part scaled by 2^12


@dataclass(frozen=True)
class EmulatedType:
    """One emulated fp32 type: parts, the part products (pairs of part indices, grouped by
    magnitude level), the scale of each level, and the magnitudes it represents exactly."""
    name: str
    part_dtype: str                   # "float16" / "bfloat16" / "tf32" (fp32 storage)
    parts: int
    levels: tuple[tuple[tuple[int, int], ...], ...]  # per level: (part of A, part of B)
    level_scale: tuple[float, ...]
    paper_range: tuple[float, float]  # as the paper states it
    min_abs: float                    # smallest nonzero |x| represented to full precision
    max_abs: float                    # largest |x| whose split stays finite (exclusive bound)
    precision: float                  # max relative representation error inside the range

    @property
    def products(self) -> int:
        return sum(len(level) for level in self.levels)


FP32_F = EmulatedType("fp32-f", "float16", 2, (((0, 0),), ((0, 1), (1, 0))), (1.0, 2.0 ** -12),
                      (6.10e-5, 6.55e4), 2.0 ** -14, 2.0 ** 15, 2.0 ** -22)
FP32_T = EmulatedType("fp32-t", "tf32", 2, (((0, 0),), ((0, 1), (1, 0))), (1.0, 1.0),
                      (4.81e-35, 3.40e38), 2.0 ** -114, 2.0 ** 127, 2.0 ** -22)
FP32_B = EmulatedType("fp32-b", "bfloat16", 3,
                      (((0, 0),), ((0, 1), (1, 0)), ((0, 2), (1, 1), (2, 0))), (1.0, 1.0, 1.0),
                      (7.70e-34, 3.40e38), 2.0 ** -110, 2.0 ** 127, 0.0)
TYPES = {t.name: t for t in (FP32_F, FP32_T, FP32_B)}


def _tf32_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> TF32 (10 mantissa bits), round to nearest even on the bits; fp32 storage."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    finite = np.isfinite(x)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & ~np.uint64(0x1FFF)).astype(np.uint32)
    return np.where(finite, rounded.view(np.float32), x).astype(np.float32)


def _round_part(x: np.ndarray, part_dtype: str) -> np.ndarray:
    """Round fp32 values to the part type; returned as fp32 values (exactly representable)."""
    if part_dtype == "tf32":
        return _tf32_round(x)
    dt = np.float16 if part_dtype == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        return x.astype(dt).astype(np.float32)


def split(x: np.ndarray, t: EmulatedType) -> list[np.ndarray]:
    """The parts of fp32 `x` in type `t`, as fp32 arrays holding part-type values
    (FP32-F's low part already scaled by 2^12)."""
    x = np.asarray(x, np.float32)
    finite = np.isfinite(x)
    xf = np.where(finite, x, np.float32(0))
    parts, rest = [], xf
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(t.parts):
            scaled = rest * F_SCALE if (t is FP32_F and i == 1) else rest
            p = _round_part(scaled, t.part_dtype)
            parts.append(p)
            rest = (rest - p).astype(np.float32)
    parts[0] = np.where(finite, parts[0], x).astype(np.float32)
    for p in parts[1:]:
        p[~finite] = 0
    return parts


def reconstruct(parts: list[np.ndarray], t: EmulatedType) -> np.ndarray:
    """The float64 value the parts stand for."""
    total = np.zeros(parts[0].shape, np.float64)
    for i, p in enumerate(parts):
        total += p.astype(np.float64) / (4096.0 if (t is FP32_F and i == 1) else 1.0)
    return total


def split_int16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int16 x = 256 * hi + lo + 128 with hi, lo int8 (hi = x >> 8, lo = (x & 255) - 128):
    both parts signed, so int8 x int8 -> int32 tensor-core GEMMs apply; the +128 is undone by
    a rank-1 correction (`int16_combine`)."""
    x = np.asarray(x, np.int16).astype(np.int32)
    return (x >> 8).astype(np.int8), ((x & 255) - 128).astype(np.int8)
