"""The numpy model of Ape's own tensor-core kernels' accumulation order (`order="mma"`) against
float64, and the kernels' source compiled by nvcc for sm_80 and sm_90. No GPU.

The order's point: each k-tile's products are summed from zero and added to the accumulator
in round-to-nearest fp32, so the error does not grow with K the way a long truncating
tensor-core sum does. Error measure as in test_reference.py (componentwise, relative to sum |A||B|)."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from conftest import require_tool

from powerfusion import ape
from powerfusion.ape import FP32_B, FP32_F, FP32_T, ApeError, mma
from powerfusion.ape.reference import MMA_K_TILE

from .test_reference import U, gemm_error, in_range, log_uniform

TYPES = [FP32_F, FP32_T, FP32_B]


def sequential_fp32(a, b):
    """C accumulated one k at a time with fused multiply-adds (round to nearest): SGEMM's
    per-thread order."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for k in range(a.shape[1]):
        acc = (acc + np.outer(a64[:, k], b64[k])).astype(np.float32)
    return acc


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [7, 256, 1000])
def test_mma_order_in_range_is_as_accurate_as_sgemm(t, k):
    rng = np.random.default_rng(k)
    a = in_range(t, (48, k), rng) if t is FP32_F else log_uniform(2.0 ** -40, 2.0 ** 40, (48, k), rng)
    b = in_range(t, (k, 40), rng) if t is FP32_F else log_uniform(2.0 ** -40, 2.0 ** 40, (k, 40), rng)
    c = ape.reference_matmul(a, b, t.name, order="mma")
    err, sgemm = gemm_error(c, a, b), gemm_error(a @ b, a, b)
    # two roundings per k-tile, plus both operands' representation error
    assert err <= (2 * -(-k // MMA_K_TILE) + 4) * U + 2 * t.precision, (err, sgemm)
    assert err <= 1.25 * sgemm + 2 * t.precision + 4 * U, (err, sgemm)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_mma_order_over_long_k_beats_a_sequential_fp32_sum(t):
    # positive data: every rounding pushes the same way, the case where long sums hurt most
    rng = np.random.default_rng(8192)
    a = rng.uniform(0.5, 2.0, (8, 8192)).astype(np.float32)
    b = rng.uniform(0.5, 2.0, (8192, 8)).astype(np.float32)
    err = gemm_error(ape.reference_matmul(a, b, t.name, order="mma"), a, b)
    seq = gemm_error(sequential_fp32(a, b), a, b)
    assert err <= 0.5 * seq, (err, seq)
    # K / 32 additions into the accumulator, not K: far below the K u bound
    assert err <= 8192 / MMA_K_TILE * U / 8, err


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_mma_order_on_normal_data(t):
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((64, 2048)).astype(np.float32), rng.standard_normal((2048, 48)).astype(np.float32)
    err = gemm_error(ape.reference_matmul(a, b, t.name, order="mma"), a, b)
    assert err <= 1.25 * gemm_error(a @ b, a, b) + 2 * t.precision, err


def test_mma_order_with_auto_over_the_full_range_keeps_specials():
    rng = np.random.default_rng(7)
    k = 1024
    a = rng.standard_normal((40, k)).astype(np.float32)
    b = rng.standard_normal((k, 32)).astype(np.float32)
    a[:, 130:140] *= np.float32(1e6)          # an FP32-B panel
    a[:, 300:310] = np.float32(1e-40)         # an fp32 panel
    c = ape.reference_matmul(a, b, "auto", order="mma")
    assert gemm_error(c, a, b) <= 1.25 * gemm_error(a @ b, a, b) + 4 * U
    a[5, 900], b[901, 7] = np.nan, np.inf
    with np.errstate(over="ignore", invalid="ignore"):
        ref, c = a @ b, ape.reference_matmul(a, b, "auto", order="mma")
    assert np.array_equal(np.isnan(ref), np.isnan(c)) and np.array_equal(np.isinf(ref), np.isinf(c))


def test_mma_order_pads_k_to_whole_tiles():
    # K = 37: the last k-tile is mostly the zeros the split kernels write past K
    rng = np.random.default_rng(37)
    a, b = rng.standard_normal((5, 37)).astype(np.float32), rng.standard_normal((37, 16)).astype(np.float32)
    for t in TYPES:
        assert gemm_error(ape.reference_matmul(a, b, t.name, order="mma"), a, b) <= 40 * U


def test_unknown_order_is_an_ape_error():
    with pytest.raises(ApeError, match="order"):
        ape.reference_matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), "fp32-f", order="fast")


def test_lower_levels_share_one_scale():
    assert mma.lower_scale(FP32_F) == 2.0 ** -12
    assert mma.lower_scale(FP32_T) == mma.lower_scale(FP32_B) == 1.0
    assert mma.lower_products(FP32_B) == ((0, 1), (1, 0), (0, 2), (1, 1), (2, 0))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_mma_kernels_compile_without_spilling_much(arch, tmp_path):
    nvcc = require_tool("nvcc")
    src = tmp_path / "ape_mma.cu"
    src.write_text(mma.source())
    assert "#include" not in mma.source()
    cubin = tmp_path / "ape_mma.cubin"
    run = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(src)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    entries = set(re.findall(r"Compiling entry function '(\w+)'", run.stderr))
    assert entries == set(mma.KERNEL_NAMES)
    # the accumulators live in registers: at most a few words of spill in any kernel
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", run.stderr)]
    assert spills and max(spills) <= 64, run.stderr


def test_shared_memory_fits_one_block_per_sm():
    # 227 KiB of dynamic shared memory per block on sm_90 (163 KiB on sm_80: the device says)
    assert all(mma.smem_bytes(m) <= 227 * 1024 for m in mma.TILINGS)


@pytest.mark.parametrize("m,n,fills", [(8192, 8192, True), (2048, 2048, True), (4096, 768, True),
                                       (100352, 256, True), (1024, 1024, False), (32, 1000, False),
                                       (100352, 64, False), (6272, 256, False), (1568, 512, False)])
def test_auto_keeps_sgemm_where_the_mma_grid_is_small(m, n, fills):
    """The benchmark GEMMs (docs/ape.md): those that ran slower than SGEMM on the mma engine are
    exactly those "auto" now leaves to SGEMM."""
    from powerfusion.ape.device import mma_fills
    assert mma_fills(m, n) == fills
