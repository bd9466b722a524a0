"""The numpy model of tensor-core accumulation (`accumulation.tc_matmul`) and of the cuBLAS
engine's plans (`reference_matmul(..., truncate=True, k_chunk=...)`) against float64. No GPU.

What the model must explain (docs/ape.md, measured on the H200): one long truncating
tensor-core sum over K is less accurate than SGEMM's round-to-nearest one and its error grows
with K; the top level in chunks of C columns has error about proportional to C / sqrt(K), so
`engine_choice.default_chunk` keeps every plan at or under SGEMM's error. Error measure as in
test_reference.py; "SGEMM" is a sequential round-to-nearest fp32 sum (its per-thread order)."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion import ape
from powerfusion.ape.accumulation import tc_matmul, truncate_to_fp32
from powerfusion.ape.engine_choice import (
    cublas_pays,
    default_chunk,
    default_chunk_sum,
    split_k_shape,
)

from .test_mma_order import sequential_fp32
from .test_reference import U, gemm_error

ULP1 = 2.0 ** -23   # fp32 ulp of 1


def test_a_group_truncates_toward_zero_where_fp32_rounds_to_nearest():
    # 1 + 0.75 ulp: kept at alignment (2 extra bits), then the fp32 result is truncated
    lhs = np.array([[1.0, 0.75 * ULP1]], np.float32)
    rhs = np.ones((2, 1), np.float32)
    assert tc_matmul(lhs, rhs, 16)[0, 0] == np.float32(1.0)
    assert (lhs @ rhs)[0, 0] == np.float32(1.0 + ULP1)
    assert tc_matmul(-lhs, rhs, 16)[0, 0] == np.float32(-1.0)
    # three quarters survive alignment together: 1 + 4 * (0.25 + 2^-30) ulp adds one ulp
    lhs = np.array([[1.0] + [0.25 * ULP1 + 2.0 ** -53] * 4], np.float32)
    assert tc_matmul(lhs, np.ones((5, 1), np.float32), 16)[0, 0] == np.float32(1.0 + ULP1)
    # below a quarter ulp of the largest addend an addend is lost, however many there are
    lhs = np.array([[1.0] + [0.2 * ULP1] * 8], np.float32)
    assert tc_matmul(lhs, np.ones((9, 1), np.float32), 16)[0, 0] == np.float32(1.0)
    assert (lhs @ np.ones((9, 1), np.float32))[0, 0] > 1.0


def test_sums_that_fit_are_exact_and_groups_start_from_the_accumulator():
    rng = np.random.default_rng(0)
    a = rng.integers(-64, 64, (8, 300)).astype(np.float32)
    b = rng.integers(-64, 64, (300, 8)).astype(np.float32)
    for step in (8, 16):
        assert np.array_equal(tc_matmul(a, b, step), a @ b)
    x = np.array([3.0, -(1 + 2 ** -30), 2 ** 30 + 1], np.float64)
    assert truncate_to_fp32(x).tolist() == [3.0, -1.0, 2.0 ** 30]


@pytest.fixture(scope="module")
def long_k():
    rng = np.random.default_rng(8192)
    a = rng.standard_normal((32, 8192)).astype(np.float32)
    b = rng.standard_normal((8192, 32)).astype(np.float32)
    return a, b, gemm_error(sequential_fp32(a, b), a, b)


@pytest.mark.parametrize("mode", ["fp32-f", "fp32-t", "fp32-b"])
def test_one_long_truncating_sum_is_worse_than_sgemm_and_grows_with_k(mode, long_k):
    a, b, sgemm = long_k
    long = gemm_error(ape.reference_matmul(a, b, mode, truncate=True), a, b)
    short = gemm_error(ape.reference_matmul(a[:, :1024], b[:1024], mode, truncate=True), a[:, :1024], b[:1024])
    assert long > 2 * sgemm, (long, sgemm)
    assert long > 1.7 * short, (long, short)
    # the same plan with round-to-nearest sums is not: the truncation is the cause
    assert gemm_error(ape.reference_matmul(a, b, mode), a, b) <= sgemm


@pytest.mark.parametrize("mode", ["fp32-f", "fp32-t", "fp32-b"])
def test_chunked_top_level_meets_sgemms_error_and_scales_with_the_chunk(mode, long_k):
    a, b, sgemm = long_k
    chunk = default_chunk(8192, 8192, 8192, mode)
    err = gemm_error(ape.reference_matmul(a, b, mode, truncate=True, k_chunk=chunk), a, b)
    assert err <= sgemm, (err, sgemm)
    # error ~ c * chunk / sqrt(K): halving the chunk about halves it
    half = gemm_error(ape.reference_matmul(a, b, mode, truncate=True, k_chunk=chunk // 2), a, b)
    assert 1.3 <= err / half <= 3.0, (err, half)


def test_only_the_top_level_needs_chunks():
    # the lower levels are 2^-8 (B) to 2^-11 (F, T) of C: their truncation stays far below an
    # fp32 ulp, so chunking every level buys nothing over chunking the top one
    rng = np.random.default_rng(2)
    a = rng.standard_normal((24, 4096)).astype(np.float32)
    b = rng.standard_normal((4096, 24)).astype(np.float32)
    for mode in ("fp32-f", "fp32-b"):
        t = ape.TYPES[mode]
        top = ape.reference_matmul(a, b, mode, truncate=True, k_chunk=512)
        pa, pb = ape.split(a, t), ape.split(b, t)
        # what the lower levels' sums run over, against what the top level's does
        lower = sum(np.abs(pa[i].astype(np.float64)) @ np.abs(pb[j].astype(np.float64)) * s
                    for level, s in zip(t.levels[1:], t.level_scale[1:]) for i, j in level)
        top_sum = np.abs(pa[0].astype(np.float64)) @ np.abs(pb[0].astype(np.float64))
        lower_share = float(np.max(lower / top_sum))
        assert lower_share < 2.0 ** -6
        assert gemm_error(top, a, b) <= 1.5 * gemm_error(ape.reference_matmul(a, b, mode, k_chunk=512), a, b) + 2 * U


def test_default_chunks_at_the_benchmark_shapes():
    assert [default_chunk(8192, 8192, 8192, m) for m in ("fp32-f", "fp32-t", "fp32-b")] == [1408, 1024, 1408]
    assert default_chunk(4096, 2304, 768, "fp32-f") == 384
    # BERT FFN2 and ResNet-50 conv5: shapes where SGEMM splits K and is 5-6x more accurate
    assert split_k_shape(4096, 768, 3072) and split_k_shape(1568, 512, 4608)
    assert not split_k_shape(4096, 768, 768) and not split_k_shape(8192, 8192, 8192)
    assert default_chunk(4096, 768, 3072, "fp32-f") == 128 and default_chunk_sum(4096, 768, 3072, "fp32-f") == "batched"
    assert default_chunk_sum(8192, 8192, 8192, "fp32-f") == "beta" and default_chunk_sum(8192, 8192, 8192, "fp32-t") == "batched"
    assert default_chunk(6272, 1024, 256, "fp32-f") == 0          # K = 256: one GEMM
    assert cublas_pays(1024, 1024, 1024) and not cublas_pays(32, 1000, 2048) and not cublas_pays(100352, 64, 576)


def test_bad_k_chunk_and_truncate_with_the_mma_order_are_ape_errors():
    f = np.ones((2, 4), np.float32)
    with pytest.raises(ape.ApeError, match="k_chunk"):
        ape.reference_matmul(f, f.T, "fp32-f", k_chunk=-1)
    with pytest.raises(ape.ApeError, match="order='mma'"):
        ape.reference_matmul(f, f.T, "fp32-f", order="mma", truncate=True)
