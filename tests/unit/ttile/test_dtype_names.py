"""BitBLAS's dtype spellings are accepted wherever ttile takes a dtype name."""
from __future__ import annotations

import pytest

from powerfusion.ttile.matmul import Matmul
from powerfusion.ttile.ttype import get_ttype


@pytest.mark.parametrize("long,short,W,out", [
    ("float16", "fp16", "int4", None),
    ("bfloat16", "bf16", "int4", "float32"),
    ("int8", "int8", "int4", "int32"),
])
def test_matmul_accepts_bitblas_spellings(long, short, W, out):
    a = Matmul(1, 256, 256, A_dtype=long, W_dtype=W, out_dtype=out,
               accum_dtype="int32" if short == "int8" else "float32")
    b = Matmul(1, 256, 256, A_dtype=short, W_dtype=W, out_dtype={"float32": "fp32"}.get(out, out))
    assert a.spec == b.spec


def test_ttypes_by_long_name():
    assert get_ttype("float16") is get_ttype("fp16")
    assert get_ttype("bfloat16") is get_ttype("bf16")
    assert get_ttype("float8_e4m3") is get_ttype("fp8_e4m3")


def test_unknown_names_are_still_refused_by_name():
    with pytest.raises(ValueError, match="float64"):
        Matmul(1, 256, 256, A_dtype="float64", W_dtype="int4")
