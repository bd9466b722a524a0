"""tType registry, encode/decode, quantisation modes and bit packing (CPU)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerfusion.ttile.quant import (dequantize, pack_bits, pack_words, quantize, unpack_bits,
                                     unpack_words, word_permutation)
from powerfusion.ttile.ttype import REGISTRY, e8m0_decode, get_ttype

FLOAT_REL = {"fp8_e4m3": 0.07, "fp8_e5m2": 0.13, "fp4_e2m1": 0.17, "nf4": 0.2, "mxfp4": 0.35, "mxfp8": 0.13}
WTYPES = ["int8", "uint8", "int4", "uint4", "int2", "uint2", "int1", "uint1", "int3", "uint5",
          "nf4", "fp4_e2m1", "fp8_e4m3", "fp8_e5m2", "mxfp4", "mxfp8"]


def test_registry_has_the_issue_types():
    for name in ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int8", "uint8", "int4",
                 "uint4", "int2", "uint2", "int1", "uint1", "nf4", "mxfp8", "mxfp4"]:
        assert name in REGISTRY
    assert get_ttype("mxfp4").shape == (32,) and get_ttype("mxfp4").shared == "e8m0"
    assert get_ttype("int3").bits == 3 and get_ttype("int3").qrange() == (-4, 3)
    with pytest.raises(KeyError):
        get_ttype("int40")


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "nf4", "int4", "uint2", "int3"])
def test_decode_encode_roundtrip_every_code(name):
    tt = get_ttype(name)
    codes = np.arange(1 << min(tt.bits, 16))
    vals = tt.decode(codes)
    finite = np.isfinite(vals)
    back = tt.encode(vals[finite])
    # -0 and +0 share a value; every other code must come back exactly
    np.testing.assert_array_equal(tt.decode(back), vals[finite])


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1", "nf4", "int4", "uint8", "int2"])
def test_loss_free_conversions(name):
    """Every value of a tType is exactly representable in each type listed in converts_to."""
    tt = get_ttype(name)
    vals = tt.decode(np.arange(1 << tt.bits))
    vals = vals[np.isfinite(vals)]
    hw = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32,
          "fp8_e4m3": ml_dtypes.float8_e4m3fn, "int8": np.int8, "int16": np.int16, "int32": np.int32}
    for target in tt.converts_to:
        np.testing.assert_array_equal(vals.astype(hw[target]).astype(np.float32), vals, err_msg=target)


def test_e8m0():
    np.testing.assert_array_equal(e8m0_decode(np.array([127, 128, 120])), [1.0, 2.0, 2.0 ** -7])
    assert np.isnan(e8m0_decode(np.array([255]))[0])


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("group", [32, 64, 128, None])
def test_quantize_error_bounded(wtype, group):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 200)).astype(np.float32)
    tt = get_ttype(wtype)
    if tt.kind == "block" and group not in (None, 32):
        with pytest.raises(ValueError):
            quantize(w, wtype, group)
        return
    zm = "original" if tt.kind == "uint" else None
    qw = quantize(w, wtype, group, zm)
    d = dequantize(qw)
    assert d.shape == w.shape and np.isfinite(d).all()
    amax = np.abs(w).max()
    if tt.kind in ("int", "uint"):   # one quantisation step (generous for 1-2 bit types)
        bound = amax * (4.0 if tt.bits <= 2 else 1.0) / max(2 ** (tt.bits - 1) - 1, 1)
    else:                            # relative spacing of the format near its top (MX: saturation)
        bound = amax * FLOAT_REL[wtype]
    assert np.abs(d - w).max() <= bound + 1e-6


@pytest.mark.parametrize("mode", ["original", "rescale", "quantized"])
def test_zero_point_modes(mode):
    rng = np.random.default_rng(2)
    w = rng.uniform(-0.2, 1.0, (4, 128)).astype(np.float32)
    qw = quantize(w, "uint4", 32, mode)
    s = np.repeat(qw.scale.astype(np.float32), 32, 1)
    z = np.repeat(qw.zeros.astype(np.float32), 32, 1)
    q = qw.codes.astype(np.float32)
    expect = q * s - z if mode == "rescale" else (q - z) * s
    np.testing.assert_array_equal(dequantize(qw), expect)
    assert qw.zeros.dtype == (np.uint8 if mode == "quantized" else np.float16)
    assert np.abs(dequantize(qw) - w).max() <= s.max() * 0.51 + 1e-3


def test_signed_codes_are_offset_binary():
    qw = quantize(np.array([[-1.0, 0.0, 1.0] + [0.0] * 29], np.float32), "int4", None)
    assert qw.codes[0, 1] == 8 and qw.codes[0, 0] == 1 and qw.codes[0, 2] == 15


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 12), k=st.integers(1, 70), seed=st.integers(0, 2 ** 16))
def test_pack_bits_roundtrip(bits, k, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, (3, k))
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, -(-k * bits // 8))     # no wasted bits beyond the last byte
    np.testing.assert_array_equal(unpack_bits(packed, bits, k), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["natural", "pair", "dp4a"])
def test_pack_words_roundtrip(bits, layout):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (5, 256)).astype(np.uint8)
    np.testing.assert_array_equal(unpack_words(pack_words(codes, bits, layout), bits, layout), codes)


def test_pair_layout_puts_element_pairs_16_bits_apart():
    codes = np.arange(8, dtype=np.uint8)[None]         # int4 word 0..7
    word = int(pack_words(codes, 4, "pair")[0, 0])
    for i in range(4):   # slot i and slot i+4 hold elements 2i, 2i+1
        assert (word >> (4 * i)) & 0xF == 2 * i and (word >> (4 * i + 16)) & 0xF == 2 * i + 1


def test_dp4a_layout_bytes_hold_consecutive_elements():
    codes = (np.arange(16, dtype=np.uint8) % 4)[None]   # int2 word
    word = int(pack_words(codes, 2, "dp4a")[0, 0])
    for j in range(4):
        lanes = [(word >> (8 * b + 2 * j)) & 3 for b in range(4)]
        assert lanes == list(codes[0, 4 * j:4 * j + 4])
    assert sorted(word_permutation(2, "dp4a")) == list(range(16))
