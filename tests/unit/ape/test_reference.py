"""The numpy model of Ape's types against float64: splits, GEMMs in and out of each type's
range, special values, block masks, int16, and the decider. No GPU.

Error measure: componentwise, |C - C64| / (|A| |B|) per element, maximum over C (relative to
the sum of |terms|, so cancellation does not blow it up); SGEMM's is numpy's fp32 matmul."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion import ape
from powerfusion.ape import FP32_B, FP32_F, FP32_T, MASK_B, MASK_F, MASK_FP32, ApeError

RNG = np.random.default_rng(19)
U = 2.0 ** -24  # fp32 unit roundoff


def log_uniform(lo, hi, shape, rng=RNG):
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def in_range(t, shape, rng=RNG):
    x = log_uniform(t.min_abs, t.max_abs, shape, rng)
    return np.where(np.abs(x) >= t.max_abs, np.float32(t.max_abs / 2), x).astype(np.float32)


def gemm_error(c, a, b) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    den = np.abs(a64) @ np.abs(b64)
    err = np.abs(c.astype(np.float64) - a64 @ b64)
    return float(np.max(np.where(den > 0, err / np.where(den > 0, den, 1), err)))


@pytest.mark.parametrize("t", [FP32_F, FP32_T, FP32_B], ids=lambda t: t.name)
def test_split_represents_every_value_in_range(t):
    x = in_range(t, 200_000)
    err = np.abs(ape.reconstruct(ape.split(x, t), t) - x.astype(np.float64)) / np.abs(x)
    assert err.max() <= t.precision, f"{t.name}: max relative representation error {err.max():.3g}"


def test_fp32_b_is_exact_and_f_t_lose_at_most_one_bit_at_the_range_edges():
    for t in (FP32_F, FP32_T, FP32_B):
        edges = np.array([t.min_abs, np.nextafter(np.float32(t.max_abs), 0), 1.0, -t.min_abs], np.float32)
        rec = ape.reconstruct(ape.split(edges, t), t)
        assert np.all(np.abs(rec - edges) <= t.precision * np.abs(edges)), t.name


def test_fp32_f_top_binade_can_overflow_its_scaled_low_part():
    # the paper states [6.10e-5, 6.55e4]; the low part scaled by 2^12 reaches 2^16 for
    # remainders near half an ulp once |x| >= 2^15, so a few values there split to Inf
    x = np.linspace(2.0 ** 15, 65504.0, 100_001).astype(np.float32)
    lo = ape.split(x, FP32_F)[1]
    assert 0 < np.count_nonzero(~np.isfinite(lo)) < 1000
    assert np.all(np.isfinite(ape.split(np.linspace(1.0, 2.0 ** 15 - 4, 100_001).astype(np.float32), FP32_F)[1]))


@pytest.mark.parametrize("t,below", [(FP32_F, 2.0 ** -20), (FP32_T, 2.0 ** -120), (FP32_B, 2.0 ** -118)],
                         ids=lambda v: getattr(v, "name", ""))
def test_below_range_loses_precision(t, below):
    x = log_uniform(below, t.min_abs / 2, 50_000)
    err = np.abs(ape.reconstruct(ape.split(x, t), t) - x.astype(np.float64)) / np.abs(x)
    assert err.max() > 8 * max(t.precision, U)


def test_above_range_overflows_to_inf():
    assert np.isinf(ape.split(np.array([70000.0], np.float32), FP32_F)[0]).all()
    big = np.array([3.4e38], np.float32)
    assert np.isinf(ape.split(big, FP32_B)[0]).all()
    assert np.isinf(ape.split(np.array([np.finfo(np.float32).max], np.float32), FP32_T)[0]).all()


@pytest.mark.parametrize("t", [FP32_F, FP32_T, FP32_B], ids=lambda t: t.name)
def test_nan_and_inf_stay_in_the_first_part(t):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    parts = ape.split(x, t)
    assert np.isnan(parts[0][0]) and parts[0][1] == np.inf and parts[0][2] == -np.inf
    assert all(np.all(p == 0) for p in parts[1:])


@pytest.mark.parametrize("mode,t", [("fp32-f", FP32_F), ("fp32-t", FP32_T), ("fp32-b", FP32_B)])
@pytest.mark.parametrize("k", [7, 256, 1000])
def test_reference_matmul_in_range_is_as_accurate_as_sgemm(mode, t, k):
    rng = np.random.default_rng(k)
    # a common scale keeps products inside fp32 (the type's range is about the inputs)
    a = in_range(t, (48, k), rng) if t is FP32_F else log_uniform(2.0 ** -40, 2.0 ** 40, (48, k), rng)
    b = in_range(t, (k, 40), rng) if t is FP32_F else log_uniform(2.0 ** -40, 2.0 ** 40, (k, 40), rng)
    c = ape.reference_matmul(a, b, mode)
    err, sgemm = gemm_error(c, a, b), gemm_error(a @ b, a, b)
    # fp32 sums of K terms (gamma_K) plus the representation error of both operands
    assert err <= (k + 4) * U + 2 * t.precision, (err, sgemm)
    assert err <= 1.25 * sgemm + 2 * t.precision + 4 * U, (err, sgemm)


@pytest.mark.parametrize("mode", ["fp32-f", "fp32-t", "fp32-b"])
def test_reference_matmul_normal_data(mode):
    a, b = RNG.standard_normal((64, 512)).astype(np.float32), RNG.standard_normal((512, 64)).astype(np.float32)
    assert gemm_error(ape.reference_matmul(a, b, mode), a, b) <= 1.25 * gemm_error(a @ b, a, b) + 2 ** -22


def test_fp32_f_out_of_range_is_wrong_and_auto_is_not():
    a = log_uniform(2.0 ** -30, 2.0 ** 30, (32, 300))
    b = log_uniform(2.0 ** -10, 2.0 ** 10, (300, 24))
    with np.errstate(invalid="ignore", over="ignore"):
        f = ape.reference_matmul(a, b, "fp32-f")
        f_err = gemm_error(f, a, b) if np.all(np.isfinite(f)) else np.inf
    sgemm = gemm_error(a @ b, a, b)
    assert f_err > 100 * sgemm
    assert gemm_error(ape.reference_matmul(a, b, "auto"), a, b) <= 1.25 * sgemm + 4 * U


def test_auto_over_the_full_fp32_range_with_subnormals_and_specials():
    k = 1024
    a = RNG.standard_normal((40, k)).astype(np.float32)
    b = RNG.standard_normal((k, 30)).astype(np.float32)
    a[:, 130:140] *= np.float32(1e6)          # panel 1 needs FP32-B
    a[:, 300:310] = np.float32(1e-40)         # panel 2: fp32 subnormals -> fp32
    b[520:530] *= np.float32(1e-30)           # panel 4 needs FP32-B
    b[700, 3] = np.float32(3e38)              # panel 5: beyond FP32-B -> fp32
    c = ape.reference_matmul(a, b, "auto")
    with np.errstate(over="ignore", invalid="ignore"):
        ref = a @ b
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(c))
    sub_a, sub_b = a.copy(), b.copy()
    sub_b[700, 3] = 0  # error away from the overflowing column
    assert gemm_error(ape.reference_matmul(sub_a, sub_b, "auto"), sub_a, sub_b) <= \
        1.25 * gemm_error(sub_a @ sub_b, sub_a, sub_b) + 4 * U
    a[5, 900], b[901, 7] = np.nan, np.inf
    with np.errstate(over="ignore", invalid="ignore"):
        ref, c = a @ b, ape.reference_matmul(a, b, "auto")
    assert np.array_equal(np.isnan(ref), np.isnan(c)) and np.array_equal(np.isinf(ref), np.isinf(c))


def test_block_mask_classes_and_partial_blocks():
    a = np.ones((5, 7), np.float32)
    a[0, 0] = 1e5        # needs FP32-B
    a[4, 6] = np.inf     # needs fp32
    a[2, 3] = 0.0        # zero is FP32-F
    m = ape.block_mask(a, (2, 4))
    assert m.shape == (3, 2)
    assert m.tolist() == [[MASK_B, MASK_F], [MASK_F, MASK_F], [MASK_F, MASK_FP32]]
    cls = ape.element_class(np.array([2.0 ** -14, 2.0 ** -15, 2.0 ** 15, 1e-39, np.nan, -3.0], np.float32))
    assert cls.tolist() == [MASK_F, MASK_B, MASK_B, MASK_FP32, MASK_FP32, MASK_F]


@pytest.mark.parametrize("args", [(np.ones(3), 2), (np.ones((2, 2)), 0)])
def test_block_mask_rejects_bad_input(args):
    with pytest.raises(ApeError):
        ape.block_mask(*args)


def test_reference_matmul_rejects_bad_operands():
    f = np.ones((2, 3), np.float32)
    with pytest.raises(ApeError, match="mode"):
        ape.reference_matmul(f, f.T, "fp16")
    with pytest.raises(ApeError, match=r"\(2, 3\) x \(2, 3\)"):
        ape.reference_matmul(f, f, "fp32-f")
    with pytest.raises(ApeError, match="float64"):
        ape.reference_matmul(f.astype(np.float64), f.T, "fp32-f")


def test_int16_is_exact_modulo_2_32_and_exact_where_it_fits():
    a = RNG.integers(-32768, 32768, (33, 257)).astype(np.int16)
    b = RNG.integers(-32768, 32768, (257, 19)).astype(np.int16)
    a[0, :], b[:, 0] = -32768, -32768
    a[1, :], b[:, 1] = 32767, 32767
    exact = a.astype(np.int64) @ b.astype(np.int64)
    c = ape.reference_matmul(a, b)
    assert c.dtype == np.int32
    assert np.array_equal(c, exact.astype(np.int32))  # wraps as int64 -> int32 does
    small = (a // 64, b // 64)
    assert np.array_equal(ape.reference_matmul(*small), small[0].astype(np.int64) @ small[1].astype(np.int64))


def test_f_block_fraction_counts_the_papers_example():
    # Fig. 4: A11, A22 and B13 need 8 exponent bits: 8 of 18 block products use FP32-B
    mask_a = np.array([[1, 0], [0, 1], [0, 0]])
    mask_b = np.array([[0, 0, 1], [0, 0, 0]])
    assert ape.f_block_fraction(mask_a, mask_b) == pytest.approx(10 / 18)


def test_decider_picks_pure_f_mixed_b_or_fp32():
    speeds = ape.Speeds(f=1.0, b=2.0, fp32=4.0, launch=0.0)
    assert ape.decide(np.zeros(8), speeds, 1.0).kind == "fp32-f"
    plan = ape.decide(np.array([0, 0, 0, 1]), speeds, 1.0)
    assert plan.kind == "mixed" and plan.panels(MASK_F).tolist() == [0, 1, 2]
    # one more GEMM costs more than the F panels save: all FP32-B
    plan = ape.decide(np.array([0, 1, 1, 1]), ape.Speeds(f=1.0, b=1.2, fp32=4.0, launch=1.0), 1.0)
    assert plan.kind == "fp32-b" and set(plan.panel_kind) == {MASK_B}
    # fp32 panels stay fp32; when the tensor cores buy nothing, all of it is SGEMM
    plan = ape.decide(np.array([2, 0, 1]), speeds, 1.0)
    assert plan.panel_kind[0] == MASK_FP32 and plan.kind == "mixed"
    assert ape.decide(np.array([1, 1]), ape.Speeds(f=1.0, b=5.0, fp32=4.0), 1.0).kind == "fp32"


def test_ape_imports_only_itself_and_the_errors_module():
    # the package stands apart from the ONNX side (read with ast, nothing imported)
    import ast
    from pathlib import Path
    root = Path(ape.__file__).parent
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("powerfusion"):
                assert node.module in ("powerfusion.errors",) or node.module.startswith("powerfusion.ape"), (f.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("powerfusion") for a in node.names), f.name
