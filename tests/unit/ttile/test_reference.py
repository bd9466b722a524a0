"""Matmul.reference (through pack -> unpack) equals a plain numpy dequantise-then-matmul,
for every (A, W, zeros, out) combination; pack/unpack round-trips bit-exactly."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from powerfusion.ttile.codegen import combinations
from powerfusion.ttile.matmul import Matmul
from powerfusion.ttile.quant import dequantize

OUT_NP = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}


@pytest.mark.parametrize("combo", combinations(), ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("K", [200, 256])
def test_reference_is_dequantise_then_matmul(combo, K):
    a, w, zm, out = combo
    rng = np.random.default_rng(K)
    M, N = 3, 20
    g = None if w.startswith("mx") else 64
    mm = Matmul(M, N, K, a, w, out_dtype=out, group_size=g, zeros_mode=zm, with_bias=True)
    qw = mm.quantize(rng.standard_normal((N, K)).astype(np.float32))
    bias = rng.integers(-9, 9, N) if out == "int32" else rng.standard_normal(N)
    packed = mm.pack(qw, bias=bias)
    back = mm.unpack(packed)                        # bit-exact round trip of codes / scales / zeros
    np.testing.assert_array_equal(back.codes, qw.codes)
    if out != "int32":
        np.testing.assert_array_equal(back.scale, qw.scale)
    if qw.zeros is not None:
        np.testing.assert_array_equal(back.zeros, qw.zeros)
    if a == "int8":
        A = rng.integers(-128, 128, (M, K)).astype(np.int8)
    else:
        A = rng.standard_normal((M, K)).astype(OUT_NP[a])
    got = mm.reference(A, packed)
    if out == "int32":
        wi = qw.codes.astype(np.int64) - (1 << (mm.wtype.bits - 1))
        np.testing.assert_array_equal(got, (A.astype(np.int64) @ wi.T + bias).astype(np.int32))
    else:
        plain = A.astype(np.float64) @ dequantize(qw).astype(np.float64).T + packed.bias.astype(np.float64)
        np.testing.assert_array_equal(got, plain.astype(OUT_NP[out]))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="no nf4 x int8"):
        Matmul(1, 8, 64, "int8", "nf4")
    with pytest.raises(ValueError, match="zero points"):
        Matmul(1, 8, 64, "fp16", "int4", zeros_mode="original").quantize(np.ones((8, 64), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        Matmul(1, 8, 256, "fp16", "int4", group_size=48)
    mm = Matmul(1, 8, 64, "fp16", "int4", group_size=32)
    with pytest.raises(ValueError, match="shape"):
        mm.pack(np.ones((8, 65), np.float32))
    with pytest.raises(ValueError, match="lie in"):
        mm.pack(np.full((8, 64), 9), scale=np.ones((8, 2)))


def test_pack_from_integer_values_and_scales():
    rng = np.random.default_rng(0)
    mm = Matmul(2, 8, 64, "fp16", "int4", group_size=32)
    vals = rng.integers(-8, 8, (8, 64))
    scale = rng.uniform(0.1, 1, (8, 2)).astype(np.float16)
    packed = mm.pack(vals, scale=scale)
    A = rng.standard_normal((2, 64)).astype(np.float16)
    w = vals * np.repeat(scale.astype(np.float32), 32, 1)
    np.testing.assert_array_equal(mm.reference(A, packed),
                                  (A.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float16))


@pytest.mark.parametrize("kernel", ["mma", "dequant", "gemv"])
@pytest.mark.parametrize("wtype,zm", [("int4", None), ("uint2", "rescale"), ("nf4", None), ("fp8_e4m3", None)])
def test_every_path_packs_and_references_alike(kernel, wtype, zm):
    rng = np.random.default_rng(5)
    mm = Matmul(16, 20, 300, "fp16", wtype, group_size=64, zeros_mode=zm, kernel=kernel)
    assert mm.kind == kernel
    qw = mm.quantize(rng.standard_normal((20, 300)).astype(np.float32))
    packed = mm.pack(qw)
    np.testing.assert_array_equal(mm.unpack(packed).codes, qw.codes)
    A = rng.standard_normal((16, 300)).astype(np.float16)
    plain = (A.astype(np.float64) @ dequantize(qw).astype(np.float64).T).astype(np.float16)
    np.testing.assert_array_equal(mm.reference(A, packed), plain)
