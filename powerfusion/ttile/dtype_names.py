"""Dtype spellings: BitBLAS's (and numpy's) long names beside our short ones.

`canonical("float16") == "fp16"`; every public ttile entry point that takes a dtype name
passes it through here first, so `Matmul(A_dtype="float16", W_dtype="int4")` works as in
BitBLAS. Names we do not know are returned unchanged, so the caller's own check names them."""
from __future__ import annotations

ALIASES = {
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32", "float": "fp32",
    "float8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e4m3_float8": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "e5m2_float8": "fp8_e5m2",
}


def canonical(name: str | None) -> str | None:
    if name is None:
        return None
    return ALIASES.get(str(name).lower(), str(name))
