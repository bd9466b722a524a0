"""The tensor-core prefill kernel on a GPU against the float64 reference (dequantised weights).

Tolerances (max |C - ref| relative to max |ref|): fp16 activations 5e-3, bf16 3e-2: each
dequantised weight is rounded once to the activation type (code x group scale), products and
sums are fp32 inside the mma; fp32 output 5e-3 as its activations are fp16."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import gpu_missing_reason

from .gpu_cases import PREFILL_COMBOS, PREFILL_MS, PREFILL_TILES, prefill_matmuls

pytestmark = pytest.mark.gpu
TOL = {"fp16": 5e-3, "bf16": 3e-2}


@pytest.fixture(autouse=True)
def _need_gpu():
    if gpu_missing_reason():
        pytest.skip(gpu_missing_reason())


def _run(mm, rng, M, splits=None, packed=None):
    """(kernel output, float64 reference) for M random activation rows."""
    import cupy as cp
    import ml_dtypes
    from powerfusion.ttile.matmul import _bits
    from .test_gpu import _to_host
    if packed is None:
        w = rng.standard_normal((mm.N, mm.K)).astype(np.float32)
        packed = mm.pack(w, bias=rng.standard_normal(mm.N) if mm.spec.with_bias else None)
    a = rng.standard_normal((M, mm.K)).astype(np.float32)
    A = a.astype(np.float16) if mm.spec.A_dtype == "fp16" else a.astype(ml_dtypes.bfloat16)
    ref = mm.reference(A, packed).astype(np.float32)
    dA = cp.asarray(_bits(A))
    if splits is None:
        out = mm(dA, packed)   # a Matmul or a DynamicMatmul
    else:
        odt = {"fp16": cp.float16, "fp32": cp.float32, "bf16": cp.uint16}[mm.spec.out_dtype]
        null = cp.zeros(1, cp.uint8)
        out = mm._call_tc(dA, mm.to_device(packed), cp.empty((M, mm.N), odt), null, splits=splits)
    return _to_host(out, mm.spec.out_dtype).astype(np.float32), ref


def _assert_close(mm, got, ref, what):
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err <= TOL[mm.spec.A_dtype], f"{mm.name} {what}: relative error {err:.2e}"


@pytest.mark.parametrize("combo", PREFILL_COMBOS, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("M", PREFILL_MS)
def test_prefill_matches_reference(combo, M):
    """Every bucket at, below and between its bounds (M is a kernel argument), N and K unaligned."""
    (mm,) = [m for m in prefill_matmuls(combo) if m.M == M]
    assert mm.kind == "tc"
    got, ref = _run(mm, np.random.default_rng(M), M)
    _assert_close(mm, got, ref, f"M={M}")


@pytest.mark.parametrize("splits", [1, 3, 17])
def test_k_splits_sum_to_the_same_result(splits):
    """The last split of a tile reduces the fp32 partials (and resets the counters: run twice)."""
    from powerfusion.ttile.matmul import Matmul
    mm = Matmul(40, 136, 17 * 128, "fp16", "int4", group_size=128, with_bias=True, kernel="tc")
    rng = np.random.default_rng(splits)
    for _ in range(2):
        got, ref = _run(mm, rng, 40, splits=splits)
        _assert_close(mm, got, ref, f"splits={splits}")


@pytest.mark.parametrize("tile", PREFILL_TILES, ids=lambda t: t.tag)
def test_benchmark_tiles(tile):
    from powerfusion.ttile.matmul import Matmul
    for M in (16, 130):
        mm = Matmul(M, 264, 1024 + 256, "fp16", "int4", group_size=128, tile=tile, kernel="tc")
        got, ref = _run(mm, np.random.default_rng(M), M)
        _assert_close(mm, got, ref, f"M={M}")


def test_dynamic_matmul_serves_every_m_from_one_packed_weight():
    from powerfusion.ttile.dispatch import DynamicMatmul
    dm = DynamicMatmul(200, 1000, "fp16", "int4", group_size=128, with_bias=True)
    rng = np.random.default_rng(0)
    packed = dm.pack(rng.standard_normal((200, 1000)).astype(np.float32), bias=rng.standard_normal(200))
    for M in (1, 3, 16, 40, 64, 128, 256):   # gemv, tc buckets, and whatever the scheduler picks at 256
        got, ref = _run(dm, rng, M, packed=packed)
        _assert_close(dm.matmul_for(M), got, ref, f"dynamic M={M}")
