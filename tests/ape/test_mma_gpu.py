"""Ape's own tensor-core kernels (engine "mma") against the numpy model of their accumulation
order and against float64 (needs CuPy and a CUDA GPU).

Kernel vs `reference_matmul(..., order="mma")`: the tensor cores truncate each k-step's and
k-tile's sum where the model rounds it, and later roundings may then differ: at most one fp32
ulp per mma of a k-tile, so (mmas per k-tile + 2) u per k-tile of sum |A||B| (u = 2^-24); a wrong
part, scale or fragment is off by 2^-11 of it or more. Against float64: at most 1.25 x SGEMM's
error (CuPy's matmul, cuBLAS) on in-range data, at a shape where cuBLAS runs its usual
kernel (at some shapes it splits K and is 10x more accurate: docs/ape.md)."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion import ape
from powerfusion.ape import ApeError
from powerfusion.ape.reference import MMA_K_STEP, MMA_K_TILE

from .test_gpu import componentwise

pytestmark = pytest.mark.gpu
U = 2.0 ** -24
RNG = np.random.default_rng(2026)
MODES = ["fp32-f", "fp32-t", "fp32-b"]


def _cp():
    import cupy
    return cupy


def in_range(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.where(np.abs(x) < 2.0 ** -12, np.float32(2.0 ** -12), x).astype(np.float32)


def _gemm(a, b, mode, **kw):
    cp = _cp()
    from powerfusion.ape.device import ApeGemm
    g = ApeGemm(cp.asarray(a), cp.asarray(b), mode, engine="mma", **kw)
    assert all(grp.engine == "mma" for grp in g.groups)
    return g, cp.asnumpy(g.run())


def _bound(k, mode):
    t = ape.TYPES[mode]
    mmas = MMA_K_TILE // MMA_K_STEP[mode] * t.products
    return (mmas + 2) * -(-k // MMA_K_TILE) * U


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(64, 512, 48), (33, 1000, 16), (256, 256, 256), (130, 37, 136), (300, 4096, 264)])
def test_kernel_matches_the_mma_order_model(mode, shape):
    m, k, n = shape
    a, b = in_range((m, k)), in_range((k, n))
    _, c = _gemm(a, b, mode)
    ref = ape.reference_matmul(a, b, mode, order="mma")
    assert componentwise(c, ref, a, b) <= _bound(k, mode)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_error_is_within_a_quarter_over_sgemms(mode):
    cp = _cp()
    a, b = in_range((2048, 2048)), in_range((2048, 2048))
    _, c = _gemm(a, b, mode)
    da, db = cp.asarray(a), cp.asarray(b)
    exact = cp.asnumpy(da.astype(np.float64) @ db.astype(np.float64))
    den = cp.asnumpy(cp.abs(da.astype(np.float64)) @ cp.abs(db.astype(np.float64)))
    sgemm = float(np.max(np.abs(cp.asnumpy(da @ db) - exact) / den))
    err = float(np.max(np.abs(c - exact) / den))
    assert err <= 1.25 * sgemm, (err, sgemm)


def test_mixed_plan_on_the_kernels_matches_the_model():
    cp = _cp()
    k = 1024
    a, b = in_range((200, k)), in_range((k, 152))
    a[:, 130:140] *= np.float32(1e6)      # an FP32-B panel
    a[:, 300:310] = np.float32(1e-40)     # an fp32 panel
    speeds = ape.Speeds(f=1.0, b=2.0, fp32=8.0, launch=0.0)
    g, c = _gemm(a, b, "auto", speeds=speeds)
    assert g.plan.kind == "mixed" and len(g.groups) == 2
    assert componentwise(c, ape.reference_matmul(a, b, "auto", order="mma"), a, b) <= _bound(k, "fp32-b")
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert componentwise(c, exact, a, b) <= 1.25 * componentwise(cp.asnumpy(cp.asarray(a) @ cp.asarray(b)), exact, a, b) + 4 * U


def test_nan_and_inf_pass_through_like_sgemm_in_auto():
    cp = _cp()
    a, b = in_range((96, 512)), in_range((512, 64))
    a[5, 200], b[301, 7] = np.nan, np.inf
    c = cp.asnumpy(ape.matmul(cp.asarray(a), cp.asarray(b), "auto", engine="mma"))
    ref = cp.asnumpy(cp.asarray(a) @ cp.asarray(b))
    assert np.array_equal(np.isnan(c), np.isnan(ref)) and np.array_equal(np.isinf(c), np.isinf(ref))


def test_kernel_run_is_graph_capturable():
    cp = _cp()
    from powerfusion.ape.device import ApeGemm
    a = cp.asarray(in_range((200, 384)))
    b = cp.asarray(in_range((384, 96)))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        gemms = [ApeGemm(a, b, mode, engine="mma") for mode in MODES]
        for g in gemms:
            g.run()
        stream.begin_capture()
        for g in gemms:
            g.run()
        graph = stream.end_capture()
        a *= 2
        graph.launch(stream)
        stream.synchronize()
    for g in gemms:
        expect = ApeGemm(a, b, g.plan.kind, engine="mma").run()
        assert cp.allclose(g.out, expect, rtol=1e-5, atol=1e-4)


def test_engine_choice_and_bad_engines():
    cp = _cp()
    from powerfusion.ape.device import ApeGemm
    a = cp.ones((16, 32), np.float32)
    assert ApeGemm(a, cp.ones((32, 12), np.float32), "fp32-f").groups[0].engine == "cublas"   # N % 8 != 0
    assert ApeGemm(a, cp.ones((32, 16), np.float32), "fp32-f", k_chunk=16).groups[0].engine == "cublas"
    with pytest.raises(ApeError, match="N % 8"):
        ApeGemm(a, cp.ones((32, 12), np.float32), "fp32-f", engine="mma")
    with pytest.raises(ApeError, match="engine"):
        ape.matmul(a, cp.ones((32, 16), np.float32), "fp32-f", engine="wgmma")
