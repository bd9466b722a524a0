"""tType: a data type as Ladder defines it (element bits, element shape, shared
metadata, loss-free conversions to hardware types), with numpy encode/decode.

Every tType stores elements as unsigned *codes* in [0, 2**bits). Signed integers use
offset binary (code = value + 2**(bits-1)), which is also what MatMulNBits' default
zero point assumes and what lets the kernels share one magic-number dequantisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# QLoRA's NF4 levels, rounded to fp16 so that the conversion to fp16 is loss-free.
NF4_LEVELS = tuple(float(np.float16(v)) for v in (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0))

_ML = {"fp16": np.float16, "fp32": np.float32, "bf16": ml_dtypes.bfloat16,
       "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
       "fp4_e2m1": ml_dtypes.float4_e2m1fn}
_CODE_DTYPE = {8: np.uint8, 16: np.uint16, 32: np.uint32}


@dataclass(frozen=True, slots=True)
class TType:
    name: str
    bits: int                       # bits per element code
    kind: str                       # float | int | uint | table | block
    shape: tuple[int, ...] = (1,)   # element shape: (1,) scalar, (32,) MX block
    table: tuple[float, ...] = ()   # value table (kind == "table")
    element: str = ""               # element tType of a block type
    shared: str = ""                # shared metadata: "" | "e8m0" (block scale)
    converts_to: tuple[str, ...] = ()  # hardware types holding every value exactly

    @property
    def signed(self) -> bool:
        return self.kind == "int"

    @property
    def block(self) -> int:
        return int(np.prod(self.shape))

    def qrange(self) -> tuple[int, int]:
        """Integer value range of int/uint types."""
        if self.kind == "int":
            return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        if self.kind == "uint":
            return 0, (1 << self.bits) - 1
        raise TypeError(f"{self.name} is not an integer tType")

    def max_value(self) -> float:
        """Largest finite magnitude of the element values."""
        if self.kind in ("int", "uint"):
            return float(max(abs(v) for v in self.qrange()))
        if self.kind == "table":
            return max(abs(v) for v in self.table)
        return float(ml_dtypes.finfo(_ML[self.element or self.name]).max)

    # -- codes <-> values (element values, before any group scale) --
    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Codes -> element values as float32 (exact for every registered type)."""
        codes = np.asarray(codes)
        if self.kind == "int":
            return (codes.astype(np.int64) - (1 << (self.bits - 1))).astype(np.float32)
        if self.kind == "uint":
            return codes.astype(np.float32)
        if self.kind == "table":
            return np.asarray(self.table, np.float32)[codes.astype(np.int64)]
        name = self.element or self.name
        store = np.dtype(_ML[name])
        return codes.astype(_CODE_DTYPE[store.itemsize * 8]).view(store).astype(np.float32)

    def encode(self, values: np.ndarray) -> np.ndarray:
        """Element values -> nearest codes (saturating), dtype uint8/16/32."""
        v = np.asarray(values, np.float32)
        cdt = _CODE_DTYPE[max(8, 1 << max(3, int(np.ceil(np.log2(self.bits)))))]
        if self.kind in ("int", "uint"):
            lo, hi = self.qrange()
            q = np.clip(np.rint(v), lo, hi).astype(np.int64)
            return (q - lo if self.kind == "int" else q).astype(cdt)
        if self.kind == "table":
            t = np.asarray(self.table, np.float32)
            return np.abs(v[..., None] - t).argmin(-1).astype(cdt)
        name = self.element or self.name
        store = np.dtype(_ML[name])
        top = float(ml_dtypes.finfo(store).max)
        x = np.clip(v, -top, top).astype(store)   # clip first: e4m3fn overflows to NaN
        raw = x.view(_CODE_DTYPE[store.itemsize * 8])
        return raw.astype(cdt)


def _int(bits: int, signed: bool) -> TType:
    kind = "int" if signed else "uint"
    hw = [t for t, b in (("int8", 8), ("int16", 16), ("int32", 32)) if bits < b or (bits == b and signed)]
    hw += ["fp16"] if bits <= 11 else []   # |value| <= 2048 is exact in fp16
    hw += ["bf16"] if bits <= 8 else []    # 8-bit significand
    return TType(f"{'int' if signed else 'uint'}{bits}", bits, kind, converts_to=tuple(hw))


REGISTRY: dict[str, TType] = {
    "fp32": TType("fp32", 32, "float", converts_to=("fp32",)),
    "fp16": TType("fp16", 16, "float", converts_to=("fp16", "fp32")),
    "bf16": TType("bf16", 16, "float", converts_to=("bf16", "fp32")),
    "fp8_e4m3": TType("fp8_e4m3", 8, "float", converts_to=("fp16", "bf16", "fp32")),
    "fp8_e5m2": TType("fp8_e5m2", 8, "float", converts_to=("fp16", "fp32")),
    "fp4_e2m1": TType("fp4_e2m1", 4, "float", converts_to=("fp8_e4m3", "fp16", "bf16", "fp32")),
    "nf4": TType("nf4", 4, "table", table=NF4_LEVELS, converts_to=("fp16", "fp32")),
    "mxfp8": TType("mxfp8", 8, "block", shape=(32,), element="fp8_e4m3", shared="e8m0",
                   converts_to=("fp32",)),
    "mxfp4": TType("mxfp4", 4, "block", shape=(32,), element="fp4_e2m1", shared="e8m0",
                   converts_to=("fp32",)),
}
for _b in (1, 2, 4, 8):
    REGISTRY[f"int{_b}"] = _int(_b, True)
    REGISTRY[f"uint{_b}"] = _int(_b, False)


def get_ttype(name: str) -> TType:
    """Registered tType, or an arbitrary-width integer spelled intN / uintN (1 <= N <= 32);
    BitBLAS's long names (float16, bfloat16, float32, float8_e4m3, ...) are accepted too."""
    from powerfusion.ttile.dtype_names import canonical
    name = canonical(name)
    if name in REGISTRY:
        return REGISTRY[name]
    for prefix, signed in (("uint", False), ("int", True)):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            bits = int(name[len(prefix):])
            if 1 <= bits <= 32:
                return _int(bits, signed)
    raise KeyError(f"unknown tType {name!r}; known: {sorted(REGISTRY)} and intN/uintN")


def e8m0_decode(codes: np.ndarray) -> np.ndarray:
    """OCP MX shared scale: 2**(code - 127) (code 255 is NaN)."""
    c = np.asarray(codes).astype(np.int64)
    out = np.ldexp(np.float32(1.0), (np.minimum(c, 254) - 127).astype(np.int32)).astype(np.float32)
    return np.where(c == 255, np.float32(np.nan), out)


def lcm_bits(*types: TType) -> int:
    """Smallest bit granularity holding a whole number of elements of every type."""
    return int(np.lcm.reduce([t.bits * t.block for t in types]))
