"""tTile transforms (numpy semantics), tTile-device hints and the hint-based scheduler."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.ttile.device import DEVICES, device_hint, schedule_typed_gemm, select_unit, word_layout
from powerfusion.ttile.ttile import TTile, convert_tile, from_values, map_tile, pad_tile, slice_tile


def _tile(dtype="fp16", shape=(4, 6)):
    return from_values(dtype, np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 5)


def test_slice_is_numpy_slicing():
    t = _tile()
    s = slice_tile(t, (1, 2), (2, 3))
    np.testing.assert_array_equal(s.values(), t.values()[1:3, 2:5])
    r = slice_tile(t, (1, 2), (2, 3), out_shape=(6,))
    np.testing.assert_array_equal(r.values(), t.values()[1:3, 2:5].reshape(6))
    with pytest.raises(ValueError):
        slice_tile(t, (3, 0), (2, 2))


def test_map_transpose_and_bijection_check():
    t = _tile()
    m = map_tile(t, lambda i, j: (j, i), out_shape=(6, 4))
    np.testing.assert_array_equal(m.values(), t.values().T)
    with pytest.raises(ValueError, match="bijection"):
        map_tile(t, lambda i, j: (i * 0, j))


def test_pad_like_numpy_and_low_bit_codes():
    t = _tile()
    p = pad_tile(t, (0, 1, 2, 0), pad_value=0.0)
    np.testing.assert_array_equal(p.values(), np.pad(t.values(), ((0, 1), (2, 0))))
    q = from_values("int4", np.array([[1, -2, 3]]))
    np.testing.assert_array_equal(pad_tile(q, (0, 0, 0, 2)).values(), [[1, -2, 3, 0, 0]])


def test_convert_only_loss_free():
    q = from_values("nf4", np.linspace(-1, 1, 16)[None])
    f = convert_tile(q, "fp16")
    assert f.dtype == "fp16"
    np.testing.assert_array_equal(f.values(), q.values())
    with pytest.raises(ValueError, match="loss-free"):
        convert_tile(_tile("fp16"), "int8")
    mx = from_values("mxfp4", np.random.default_rng(0).standard_normal((2, 64)))
    np.testing.assert_array_equal(convert_tile(mx, "fp32").values(), mx.values())
    assert slice_tile(mx, (0, 32), (2, 32)).shared.shape == (2, 1)


def test_device_hint_aligns_every_level():
    hint = device_hint(DEVICES["sm_80"])
    assert hint.granularity_bits == 128                 # ldmatrix's 16 bytes
    assert hint.inner_bytes % 32 == 0 and hint.inner_bytes % 128 == 0   # global txn, 32 banks x 4 B
    assert hint.shape[0] % 16 == 0


def test_layout_is_the_map_the_unit_needs():
    dev = DEVICES["sm_90"]
    assert word_layout("int4", select_unit(dev, "fp16", "int4", False)) == "pair"
    assert word_layout("int2", select_unit(dev, "int8", "int2", False)) == "dp4a"
    assert word_layout("nf4", select_unit(dev, "fp16", "nf4", False)) == "natural"
    assert select_unit(dev, "fp16", "int4", True).name.startswith("mma")


def test_schedule_places_convert_by_cost():
    small = schedule_typed_gemm(1, 8192, 8192, "fp16", "int4", 128)
    big = schedule_typed_gemm(1024, 8192, 8192, "fp16", "int4", 128)
    assert small.convert_at == "register" and big.convert_at == "global"
    odd = schedule_typed_gemm(1, 64, 1000, "fp16", "int4", 128)
    assert odd.k_pad == 1024 and any(t.kind == "pad" for t in odd.transforms)
    assert [t.kind for t in small.transforms][-1] == "convert"


@pytest.mark.parametrize("wtype,layout", [("int4", "pair"), ("int2", "pair"), ("int8", "pair"), ("int1", "pair"),
                                          ("nf4", "natural"), ("fp8_e4m3", "natural")])
def test_mma_pack_feeds_the_fragments(wtype, layout):
    """Emulate the tensor-core kernel's reading order on the packed words: for each lane,
    word and k16 step, the two pairs it hands to mma as B must be W[g, k0+2t(+1)] and
    W[g, k0+2t+8(+9)]; summing fragment products reproduces A @ W^T exactly."""
    from powerfusion.ttile.quant import pack_mma, unpack_words
    from powerfusion.ttile.ttype import get_ttype
    bits = get_ttype(wtype).bits
    E = 32 // bits
    N, K, M = 16, 32 * E, 3
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (N, K)).astype(np.uint8)
    A = rng.integers(-3, 4, (M, K)).astype(np.int64)
    words = pack_mma(codes, bits, layout).reshape(N // 8, K // (16 * E), 32, 4)
    C = np.zeros((M, N), np.int64)
    for nt in range(N // 8):
        for kc in range(K // (16 * E)):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                elems = unpack_words(words[nt, kc, lane].reshape(4, 1), bits, layout).reshape(4, E)
                for wi in range(4):
                    pairs = elems[wi].reshape(E // 2, 2)       # pair i = elements 2i, 2i+1
                    for st in range(E // 4):
                        k0 = kc * 16 * E + (wi * (E // 4) + st) * 16
                        for which in range(2):
                            ks = k0 + 2 * t + 8 * which + np.arange(2)
                            np.testing.assert_array_equal(pairs[2 * st + which], codes[nt * 8 + g, ks])
                            C[:, nt * 8 + g] += A[:, ks] @ pairs[2 * st + which].astype(np.int64)
    np.testing.assert_array_equal(C, A @ codes.T.astype(np.int64))


def test_gemv_chunks_per_step_follow_the_grid():
    """At M = 1 a lane loads two chunks per step for 8-bit weights, and for int4 where the grid
    leaves each SM fewer than four blocks and the activations are staged; table types, larger
    grids, unstaged activations and M > 1 keep one; an
    explicit batch wins; anything but 1, 2, 4 or 8 is refused."""
    from powerfusion.ttile.matmul import Matmul
    assert Matmul(1, 4096, 4096, "fp16", "int4").spec.batch == 2        # 256 blocks < 4 x 132
    assert Matmul(1, 12288, 4096, "fp16", "int4").spec.batch == 1       # 768 blocks
    assert Matmul(1, 8192, 28672, "fp16", "int4").spec.batch == 1       # activations not staged
    assert Matmul(1, 12288, 4096, "fp16", "fp8_e4m3").spec.batch == 2
    assert Matmul(1, 4096, 4096, "fp16", "nf4").spec.batch == 1
    assert Matmul(1, 4096, 4096, "int8", "int2").spec.batch == 1
    assert Matmul(4, 4096, 4096, "fp16", "int4").spec.batch == 1
    mm = Matmul(1, 12288, 4096, "fp16", "int4", batch=4)
    assert mm.spec.batch == 4 and "b4" in mm.name and "#define B_ 4" in mm.source
    with pytest.raises(ValueError, match="batch"):
        Matmul(1, 64, 256, "fp16", "int4", batch=3)
