"""tTile: a row-major tile of one tType, and Ladder's four transforms (slice, map, pad,
convert), each with numpy semantics.

`data` holds element codes for low-bit types (see ttype) and plain values for the
hardware types numpy stores natively; block types keep their shared e8m0 scales in
`shared`, one per block of the last axis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np

from .ttype import TType, e8m0_decode, get_ttype

NATIVE = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16,
          "int8": np.int8, "int16": np.int16, "int32": np.int32}


@dataclass(frozen=True)
class TTile:
    dtype: str
    data: np.ndarray
    shared: np.ndarray | None = field(default=None)   # block types: e8m0 code per block

    @property
    def ttype(self) -> TType:
        return get_ttype(self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbits(self) -> int:
        """Storage bits of the elements (metadata excluded)."""
        return int(self.data.size) * self.ttype.bits

    def values(self) -> np.ndarray:
        """Element values as float64 (scaled by the shared block scale where there is one)."""
        tt = self.ttype
        if self.dtype in NATIVE:
            return self.data.astype(np.float64)
        v = tt.decode(self.data).astype(np.float64)
        if tt.kind == "block":
            v = v * np.repeat(e8m0_decode(self.shared), tt.block, axis=-1)[..., :v.shape[-1]]
        return v


def from_values(dtype: str, values: np.ndarray) -> TTile:
    """A tile holding `values` (rounded to the type; block types get their shared scale)."""
    v = np.asarray(values, np.float32)
    if dtype in NATIVE:
        return TTile(dtype, v.astype(NATIVE[dtype]))
    tt = get_ttype(dtype)
    if tt.kind == "block":
        from .quant import quantize
        flat = v.reshape(-1, v.shape[-1])
        qw = quantize(flat, dtype, tt.block)
        return TTile(dtype, qw.codes.reshape(v.shape), qw.scale.reshape(*v.shape[:-1], -1))
    return TTile(dtype, tt.encode(v))


def slice_tile(t: TTile, index: tuple[int, ...], shape: tuple[int, ...],
               out_shape: tuple[int, ...] | None = None) -> TTile:
    """Elements [index, index + shape) as a new tile, reshaped (row-major) to out_shape."""
    if len(index) != t.data.ndim or len(shape) != t.data.ndim:
        raise ValueError(f"slice of a {t.data.ndim}-d tile needs {t.data.ndim}-d index and shape")
    if any(i < 0 or i + s > d for i, s, d in zip(index, shape, t.shape)):
        raise ValueError(f"slice {index}+{shape} exceeds tile shape {t.shape}")
    sl = tuple(slice(i, i + s) for i, s in zip(index, shape))
    data = t.data[sl]
    shared = None
    if t.shared is not None:
        b = t.ttype.block
        if index[-1] % b or shape[-1] % b:
            raise ValueError(f"{t.dtype} slices must keep whole {b}-element blocks")
        shared = t.shared[sl[:-1] + (slice(index[-1] // b, (index[-1] + shape[-1]) // b),)]
    if out_shape is not None:
        data = data.reshape(out_shape)
        shared = None if shared is None else shared.reshape(*out_shape[:-1], -1)
    return TTile(t.dtype, np.asarray(data, order="C"), shared)


def map_tile(t: TTile, fn: Callable[..., tuple], out_shape: tuple[int, ...] | None = None) -> TTile:
    """Element layout change: the element at index i moves to fn(*i) (a bijection onto
    out_shape). fn takes and returns index arrays, numpy-vectorised."""
    if t.shared is not None:
        raise ValueError("map of a block-scaled tile: convert it first")
    out_shape = out_shape or t.shape
    if int(np.prod(out_shape)) != t.data.size:
        raise ValueError(f"map must keep the element count: {t.shape} -> {out_shape}")
    src = np.indices(t.shape).reshape(t.data.ndim, -1)
    dst = tuple(np.asarray(d).reshape(-1) for d in fn(*src))
    flat = np.ravel_multi_index(dst, out_shape)
    if np.unique(flat).size != flat.size:
        raise ValueError("map function is not a bijection")
    out = np.empty(out_shape, t.data.dtype)
    out[dst] = t.data.reshape(-1)
    return TTile(t.dtype, out)


def pad_tile(t: TTile, pad_shape: tuple[int, ...], pad_value: float = 0.0) -> TTile:
    """pad_shape = (left0, right0, left1, right1, ...), as in Ladder's pad primitive."""
    if len(pad_shape) != 2 * t.data.ndim:
        raise ValueError(f"pad_shape needs {2 * t.data.ndim} entries, got {len(pad_shape)}")
    widths = [(pad_shape[2 * i], pad_shape[2 * i + 1]) for i in range(t.data.ndim)]
    code = pad_value if t.dtype in NATIVE else from_values(t.dtype, np.array([pad_value])).data[0]
    shared = None
    if t.shared is not None:
        b = t.ttype.block
        if any(w % b for w in widths[-1]):
            raise ValueError(f"{t.dtype} pads whole {b}-element blocks")
        shared = np.pad(t.shared, widths[:-1] + [(widths[-1][0] // b, widths[-1][1] // b)],
                        constant_values=127)
        code = t.ttype.encode(np.array([pad_value]))[0] if t.ttype.kind != "block" else \
            get_ttype(t.ttype.element).encode(np.array([pad_value]))[0]
    return TTile(t.dtype, np.pad(t.data, widths, constant_values=code), shared)


def convert_tile(t: TTile, new_dtype: str) -> TTile:
    """Change the tType; only loss-free conversions listed in the tType's converts_to."""
    if new_dtype == t.dtype:
        return t
    if new_dtype not in t.ttype.converts_to:
        raise ValueError(f"{t.dtype} -> {new_dtype} is not a loss-free conversion "
                         f"(allowed: {t.ttype.converts_to})")
    vals = t.values()
    out = from_values(new_dtype, vals)
    if not np.array_equal(out.values(), vals, equal_nan=True):   # guards the registry's claim
        raise ValueError(f"{t.dtype} -> {new_dtype} lost precision")
    return out
