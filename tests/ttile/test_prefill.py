"""The tensor-core prefill kernel without a GPU: its fragment flow (a numpy model of what each
lane extracts from the GEMV's packed words) against a plain matmul, the K split, the M buckets,
the shared weight layout, and an nvcc compile of every bucket's kernel for sm_80 and sm_90."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.ttile import prefill
from powerfusion.ttile.dispatch import DynamicMatmul
from powerfusion.ttile.matmul import Matmul
from powerfusion.ttile.quant import pack_words
from powerfusion.ttile.ttype import get_ttype


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_fragments_of_pair_words_give_the_matmul(splits):
    """int4 'pair' words: lane t's shift by 4t + mask 0x000f000f is the B fragment (codes 2t, 2t+1)."""
    rng = np.random.default_rng(splits)
    M, N, K = 32, 16, 3 * prefill.BK
    codes = rng.integers(0, 16, (N, K))
    A = rng.integers(-4, 5, (M, K)).astype(np.float64)
    got = prefill.emulate(A, pack_words(codes, 4, "pair"), 4, "pair", splits=splits, offset=8)
    np.testing.assert_array_equal(got, A @ (codes - 8).T)


def test_fragments_of_table_words_give_the_matmul():
    """NF4 'natural' words: byte t holds codes 2t, 2t+1, looked up as one pair."""
    rng = np.random.default_rng(7)
    M, N, K = 16, 8, 2 * prefill.BK
    table = np.asarray(get_ttype("nf4").table)
    codes = rng.integers(0, 16, (N, K))
    A = rng.standard_normal((M, K))
    got = prefill.emulate(A, pack_words(codes, 4, "natural"), 4, "natural", table=table)
    np.testing.assert_allclose(got, A @ table[codes].T, rtol=1e-12, atol=1e-12)


def test_a_wrong_lane_mapping_is_caught():
    """The model is sensitive to the fragment layout (shifting by 8t instead of 4t breaks it)."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (8, prefill.BK))
    words = pack_words(codes, 4, "pair")
    A = rng.standard_normal((16, prefill.BK))
    good = prefill.emulate(A, words, 4, "pair", offset=8)
    bad = prefill.emulate(A, words, 4, "natural", offset=8)
    assert np.allclose(good, A @ (codes - 8).T) and not np.allclose(bad, good)


@pytest.mark.parametrize("chunks,splits", [(1, 1), (7, 3), (64, 7), (32, 8), (224, 5)])
def test_split_ranges_cover_k_once(chunks, splits):
    rs = prefill.split_ranges(chunks, splits)
    assert rs[0][0] == 0 and rs[-1][1] == chunks
    assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))
    assert all(c1 - c0 >= chunks // splits for c0, c1 in rs)


@pytest.mark.parametrize("M,N,K", [(16, 4096, 4096), (16, 57344, 8192), (64, 8192, 28672), (256, 8192, 8192),
                                   (16, 96, 256)])
def test_splits_fill_the_gpu_and_keep_four_chunks(M, N, K):
    tile = prefill.tile_for(M)
    s = prefill.choose_splits(M, N, K, tile, sms=132)
    chunks = K // prefill.BK
    assert s >= 1 and (s == 1 or chunks // s >= 4)
    tiles, slots = -(-M // tile.bm) * -(-N // tile.bn), 132 * prefill.occupancy(tile, False)
    span = (lambda s: -(-tiles * s // slots) * -(-chunks // s))
    if tiles >= slots:
        assert s == 1     # the tiles fill the GPU: no fp32 partials
    else:
        top = max(1, min(chunks // 4, 2 * -(-slots // tiles)))   # at most 2 waves
        assert s <= top and all(span(s) <= span(x) for x in range(1, top + 1))   # the best makespan


def test_buckets_are_ordered_and_fit_shared_memory():
    tops = [top for top, _ in prefill.M_BUCKETS]
    assert tops[-1] is None and tops[:-1] == sorted(tops[:-1])
    for tile in [t for _, t in prefill.M_BUCKETS] + list(prefill.CANDIDATE_TILES):
        assert tile.smem_bytes(lut=True) <= prefill.SMEM_PER_SM and tile.threads <= 1024
    assert prefill.tile_for(16).bm == 16 and prefill.tile_for(17) == prefill.tile_for(32)
    assert prefill.tile_for(4096) == prefill.M_BUCKETS[-1][1]


@pytest.mark.parametrize("a,w,zm,group,K,why", [
    ("int8", "int4", None, 128, 1024, "activations"), ("fp16", "int2", None, 128, 1024, "weights"),
    ("fp16", "mxfp4", None, 32, 1024, "weights"), ("fp16", "uint4", "original", 128, 1024, "zero points"),
    ("fp16", "int4", None, 64, 1024, "group 64"), ("fp16", "int4", None, 128, 1004, "K = 1004")])
def test_unsupported_cases_name_the_reason(a, w, zm, group, K, why):
    zmode = zm or ("sym" if get_ttype(w).kind == "int" else "none")
    reason = prefill.supports(a, w, zmode, group, K, -(-K // 128) * 128)
    assert reason and why in reason
    assert prefill.supports("fp16", "int4", "sym", 128, 1000, 1024) is None


@pytest.mark.parametrize("w,zm", [("int4", None), ("uint4", "quantized"), ("nf4", None), ("fp4_e2m1", None)])
def test_scheduler_picks_the_prefill_kernel_on_the_gemv_layout(w, zm):
    decode = Matmul(1, 200, 1000, "fp16", w, group_size=128, zeros_mode=zm)
    for M in (16, 64, 256):
        mm = Matmul(M, 200, 1000, "fp16", w, group_size=128, zeros_mode=zm, kernel=None if M < 256 else "tc")
        assert mm.kind == "tc" and mm.spec.tile == prefill.tile_for(M)   # at 256 the model may pick dequant
        assert mm.spec.K_pad == decode.spec.K_pad and mm.spec.layout == decode.spec.layout
        weight = np.random.default_rng(M).standard_normal((200, 1000)).astype(np.float32)
        a, b = mm.pack(weight), decode.pack(weight)
        np.testing.assert_array_equal(a.words, b.words)
        np.testing.assert_array_equal(a.scale, b.scale)
    assert Matmul(16, 200, 1000, "fp16", "int4", group_size=64).kind != "tc"   # group 64: older paths


def test_dynamic_matmul_picks_by_rows():
    dm = DynamicMatmul(200, 1000, "fp16", "int4", group_size=128)
    assert dm.matmul_for(1).kind == "gemv" and dm.matmul_for(15).kind == "gemv"
    assert dm.matmul_for(16).kind == "tc" and dm.matmul_for(20) is dm.matmul_for(32)   # one kernel per bucket
    assert dm.matmul_for(33).spec.tile == prefill.tile_for(64)
    big = Matmul(256, 200, 1000, "fp16", "int4", group_size=128).kind   # the scheduler's pick for the last bucket
    assert dm.kernel_for(300) == big and dm.matmul_for(300).kind == big
    assert big != "tc" or dm.matmul_for(300) is dm.matmul_for(1000)
    assert DynamicMatmul(200, 1000, "fp16", "int4", group_size=64).matmul_for(16).kind == "dequant"   # no tc: same words
    with pytest.raises(ValueError, match="rows"):
        dm.matmul_for(0)


def test_prefill_kernels_compile_for_sm80_and_sm90(tmp_path, nvcc):
    from .test_nvcc import _compile_batched
    kernels = {}
    for a, w, zm, g in (("fp16", "int4", None, 128), ("bf16", "int4", None, 128), ("fp16", "nf4", None, 128),
                        ("bf16", "uint4", "quantized", 256), ("fp16", "fp4_e2m1", None, None)):
        for M in (16, 32, 64, 256):
            mm = Matmul(M, 200, 1000, a, w, group_size=g, zeros_mode=zm, with_bias=M == 64,
                        out_dtype="fp32" if M == 32 else None, kernel="tc")
            assert mm.kind == "tc", mm.name
            kernels[mm.name] = mm
    _compile_batched(tmp_path, list(kernels.values()))


@pytest.mark.parametrize("group", [128, 256, 512])
def test_fp32_scaling_algebra(group):
    """acc += s * (A . (magic + q) - (magic + z) * sum(A)) per chunk equals A . (s * (q - z)), for groups
    of one or several chunks (per channel: one group)."""
    rng = np.random.default_rng(group)
    M, N, K = 5, 12, 512
    codes = rng.integers(0, 16, (N, K)).astype(np.float64)
    scale = rng.uniform(0.01, 0.1, (N, K // group))
    zero = rng.integers(0, 16, (N, K // group)).astype(np.float64)
    A = rng.integers(-8, 9, (M, K)).astype(np.float64)
    w = (codes - np.repeat(zero, group, axis=1)) * np.repeat(scale, group, axis=1)
    np.testing.assert_allclose(prefill.emulate_fp32_scale(A, codes, scale, zero, group), A @ w.T, rtol=1e-9, atol=1e-9)
