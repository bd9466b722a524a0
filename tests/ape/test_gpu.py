"""Ape's device kernels against the numpy model (needs CuPy and a CUDA GPU).

Splits and masks must agree bit for bit. GEMMs: the device accumulates in another order
and the tensor cores truncate, so a device result may differ from `reference_matmul` by
two fp32 summations' error bounds, 2 K u sum(|A||B|) per element (u = 2^-24); a wrong part,
scale or level is off by 2^-11 or more of it."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion import ape
from powerfusion.ape import FP32_B, FP32_F, FP32_T, ApeError

pytestmark = pytest.mark.gpu
U = 2.0 ** -24
RNG = np.random.default_rng(1919)


def _cp():
    import cupy
    return cupy


def componentwise(c, ref, a, b) -> float:
    den = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    return float(np.max(np.abs(c.astype(np.float64) - ref.astype(np.float64)) / np.where(den > 0, den, 1)))


def mixed_values(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    n = flat.size
    flat[RNG.choice(n, n // 50, replace=False)] *= np.float32(2.0 ** 40)
    flat[RNG.choice(n, n // 50, replace=False)] *= np.float32(2.0 ** -40)
    flat[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3.3e38, 65519.0]
    return x


@pytest.mark.parametrize("t", [FP32_F, FP32_T, FP32_B], ids=lambda t: t.name)
def test_split_kernels_match_the_model_bit_for_bit(t):
    cp = _cp()
    from powerfusion.ape.device import _EmulatedGroup
    a = mixed_values((37, 300))
    b = mixed_values((300, 29))
    g = _EmulatedGroup(t.name[-1], cp.asarray(a), cp.asarray(b), None, None)
    g.run(cp.asarray(a), cp.asarray(b), cp.zeros((37, 29), np.float32), True)
    parts_a = cp.asnumpy(g.a_parts).reshape(37, t.parts, 300)
    parts_b = cp.asnumpy(g.b_parts).reshape(t.parts, 300, 29)[::-1]
    for i, (pa, pb) in enumerate(zip(ape.split(a, t), ape.split(b, t))):
        da, db = _as_f32(parts_a[:, i], t), _as_f32(parts_b[i], t)
        assert np.array_equal(da, pa, equal_nan=True), f"A part {i}"
        assert np.array_equal(db, pb, equal_nan=True), f"B part {i}"


def _as_f32(bits, t):
    import ml_dtypes
    if t.part_dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    if t.part_dtype == "bfloat16":
        return bits.view(ml_dtypes.bfloat16).astype(np.float32)
    return bits


@pytest.mark.parametrize("cols", [517, 516])   # 516: rows 16-byte aligned, the float4 path
def test_block_mask_kernel_matches_the_model(cols):
    from powerfusion.ape.device import block_mask_device
    x = mixed_values((300, cols))
    for block in (128, (64, 100), 7, (5, 8)):
        assert np.array_equal(block_mask_device(_cp().asarray(x), block), ape.block_mask(x, block))


@pytest.mark.parametrize("mode", ["fp32-f", "fp32-t", "fp32-b", "fp32"])
@pytest.mark.parametrize("shape", [(64, 512, 48), (33, 1000, 17), (256, 256, 256)])
@pytest.mark.parametrize("k_chunk", [None, 128])
def test_matmul_matches_reference(mode, shape, k_chunk):
    cp = _cp()
    m, k, n = shape
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal((k, n)).astype(np.float32)
    from powerfusion.ape.device import ApeGemm
    c = cp.asnumpy(ApeGemm(cp.asarray(a), cp.asarray(b), mode, k_chunk=k_chunk).run())
    ref = ape.reference_matmul(a, b, mode)
    assert componentwise(c, ref, a, b) <= 2 * k * U
    exact = a.astype(np.float64) @ b.astype(np.float64)
    sgemm = componentwise(cp.asnumpy(cp.asarray(a) @ cp.asarray(b)), exact, a, b)
    assert componentwise(c, exact, a, b) <= max(4 * sgemm, 2 * k * U)


def test_auto_over_mixed_ranges_is_never_worse_than_sgemm():
    cp = _cp()
    k = 1024
    a = _away_from_zero(RNG.standard_normal((200, k)).astype(np.float32))
    b = _away_from_zero(RNG.standard_normal((k, 150)).astype(np.float32))
    a[:, 130:140] *= np.float32(1e6)      # a panel that needs FP32-B
    a[:, 300:310] = np.float32(1e-40)     # a panel of fp32 subnormals: SGEMM
    b[520:530] *= np.float32(1e-30)
    da, db = cp.asarray(a), cp.asarray(b)
    from powerfusion.ape.device import ApeGemm
    speeds = ape.Speeds(f=1.0, b=2.0, fp32=8.0, launch=0.0)
    # engine named: at 200 x 150 the default engine choice would run SGEMM (engine_choice.cublas_pays)
    g = ApeGemm(da, db, "auto", speeds=speeds, engine="cublas")
    assert g.plan.kind == "mixed"
    assert g.plan.panel_kind[1] == ape.MASK_B and g.plan.panel_kind[2] == ape.MASK_FP32 and g.plan.panel_kind[0] == ape.MASK_F
    c = cp.asnumpy(g.run())
    exact = a.astype(np.float64) @ b.astype(np.float64)
    sgemm = componentwise(cp.asnumpy(da @ db), exact, a, b)
    assert componentwise(c, exact, a, b) <= 1.25 * sgemm + 4 * U
    assert componentwise(c, ape.reference_matmul(a, b, "auto"), a, b) <= 2 * k * U
    a[5, 900], b[901, 7] = np.nan, np.inf
    c = cp.asnumpy(ape.matmul(cp.asarray(a), cp.asarray(b), "auto"))
    ref = cp.asnumpy(cp.asarray(a) @ cp.asarray(b))
    assert np.array_equal(np.isnan(c), np.isnan(ref)) and np.array_equal(np.isinf(c), np.isinf(ref))


@pytest.mark.parametrize("mode", ["fp32-f", "fp32-b"])
@pytest.mark.parametrize("k_chunk", [0, 256])
def test_cublas_engine_sums_as_the_tensor_core_model_says(mode, k_chunk):
    """cuBLAS's fp16 / bf16 GEMMs against `accumulation.tc_matmul` (groups of 16 products,
    aligned with 2 extra bits and truncated): measured bit-exact in 91-99 % of outputs at this
    size, within a fifth of an ulp of sum |A||B| elsewhere; the round-to-nearest model is 7 ulps
    off unchunked. TF32 is left out: at such small grids cuBLAS splits its K."""
    cp = _cp()
    from powerfusion.ape.device import ApeGemm
    a = RNG.standard_normal((64, 1024)).astype(np.float32)
    b = RNG.standard_normal((1024, 64)).astype(np.float32)
    c = cp.asnumpy(ApeGemm(cp.asarray(a), cp.asarray(b), mode, engine="cublas", k_chunk=k_chunk).run())
    tc = ape.reference_matmul(a, b, mode, k_chunk=k_chunk, truncate=True)
    assert np.mean(c == tc) >= 0.5
    assert componentwise(c, tc, a, b) <= U
    if not k_chunk:   # the long truncating sum is what the model explains
        assert componentwise(c, ape.reference_matmul(a, b, mode), a, b) > 2 * U


def _away_from_zero(x):
    # N(0, 1) has a few values below FP32-F's 2^-14 per 10^4; keep panel 0 an FP32-F panel
    return np.where(np.abs(x) < 2.0 ** -12, np.float32(2.0 ** -12), x).astype(np.float32)


@pytest.mark.parametrize("shape", [(64, 100, 48), (129, 300, 77), (512, 2048, 256)])
def test_int16_is_bit_exact(shape):
    cp = _cp()
    m, k, n = shape
    a = RNG.integers(-32768, 32768, (m, k)).astype(np.int16)
    b = RNG.integers(-32768, 32768, (k, n)).astype(np.int16)
    a[0], b[:, 0] = -32768, -32768
    c = cp.asnumpy(ape.matmul(cp.asarray(a), cp.asarray(b)))
    assert c.dtype == np.int32
    assert np.array_equal(c, (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32))
    assert np.array_equal(c, ape.reference_matmul(a, b))


def test_run_is_graph_capturable_and_replays_with_new_values():
    cp = _cp()
    from powerfusion.ape.device import ApeGemm, Int16Gemm
    a = cp.asarray(RNG.standard_normal((128, 384)).astype(np.float32))
    b = cp.asarray(RNG.standard_normal((384, 96)).astype(np.float32))
    ai = cp.asarray(RNG.integers(-32768, 32768, (64, 160)).astype(np.int16))
    bi = cp.asarray(RNG.integers(-32768, 32768, (160, 32)).astype(np.int16))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        gemms = [ApeGemm(a, b, mode) for mode in ("fp32-f", "fp32-t", "fp32-b", "fp32")] + [Int16Gemm(ai, bi)]
        for g in gemms:
            g.run()
        stream.begin_capture()
        for g in gemms:
            g.run()
        graph = stream.end_capture()
        a *= 2
        ai //= 3
        graph.launch(stream)
        stream.synchronize()
    for g in gemms[:-1]:
        expect = ApeGemm(a, b, g.plan.kind).run()
        # the replay saw the doubled A (a stale replay is off by a factor of 2)
        assert cp.allclose(g.out, expect, rtol=1e-5, atol=1e-4)
    assert cp.array_equal(gemms[-1].out, ape.matmul(ai, bi))


def test_bad_operands_raise_ape_errors():
    cp = _cp()
    f = cp.ones((4, 3), np.float32)
    with pytest.raises(ApeError, match="CuPy"):
        ape.matmul(np.ones((4, 3), np.float32), f.T)
    with pytest.raises(ApeError, match=r"\(4, 3\) x \(4, 3\)"):
        ape.matmul(f, f)
    with pytest.raises(ApeError, match="int16 x int16"):
        ape.matmul(f, f.T.astype(np.float16))
    with pytest.raises(ApeError, match="out must be"):
        ape.matmul(f, f.T, "fp32-f", out=cp.empty((4, 4), np.float64))
    with pytest.raises(ApeError, match="mode"):
        ape.matmul(f, f.T, "fp16")
