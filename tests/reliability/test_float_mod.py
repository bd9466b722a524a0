"""ONNX Mod with fmod=0 on floats is numpy's floored remainder: the result takes the divisor's
sign, a zero result is signed as the divisor, and x % +-inf keeps x or gives +-inf. The C-style
dialects once spelled it a - b * floor(a / b), which gives NaN for an infinite divisor, +0.0
where numpy gives -0.0, and loses the remainder of a large quotient (found by the CUDA run of
ONNX's test_mod_float_edge_cases_fmod_0 cases). Every dialect now calls its pf_floor_modf helper.
The comparisons are bit-exact: fmod is exact, and so is the one correcting addition here.

Also here: a rank-0 output (Size, folded at import) keeps its shape () on the CUDA session
(numpy's ascontiguousarray returns at least one dimension)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

EDGE_X = [0.0, -0.0, 0.0, -0.0, -3.0, 3.0, -1.0, 1.0, np.inf, -np.inf, 1.0, 1.0, np.nan, 1.0,
          1e10, -1e10, 7.5, -7.5, 5.0, -5.0]
EDGE_Y = [-2.0, 2.0, 2.0, -2.0, np.inf, np.inf, -np.inf, -np.inf, 2.0, 2.0, 0.0, -0.0, 2.0, np.nan,
          3.0, 3.0, -2.0, 2.0, 2.5, -2.5]


def _mod_model(elem: int, n: int):
    g = h.make_graph([h.make_node("Mod", ["x", "y"], ["z"], fmod=0)], "float_mod",
                     [h.make_tensor_value_info("x", elem, [n]), h.make_tensor_value_info("y", elem, [n])],
                     [h.make_tensor_value_info("z", elem, [n])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _feeds(dtype):
    rng = np.random.default_rng(3)
    x = np.concatenate([np.array(EDGE_X), rng.standard_normal(44) * 100]).astype(dtype)
    y = np.concatenate([np.array(EDGE_Y), rng.standard_normal(44) * 10]).astype(dtype)
    return x, y


def _assert_bit_equal(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))   # -0.0 vs 0.0


def _size_model():
    g = h.make_graph([h.make_node("Size", ["x"], ["n"])], "size",
                     [h.make_tensor_value_info("x", T.FLOAT, [3, 5])], [h.make_tensor_value_info("n", T.INT64, [])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_every_gpu_dialect_spells_float_mod_with_its_helper():
    from powerfusion.backends.cuda.renderer import CUDARenderer
    from powerfusion.backends.hip.renderer import HIPRenderer
    for r in (CUDARenderer(), HIPRenderer()):
        assert r.scalar("floor_mod", {}, ["a", "b"], "float32") == "pf_floor_modf(a, b)"


def _check_float_mod(target: str, dtype, elem: int) -> None:
    import powerfusion
    x, y = _feeds(dtype)
    with np.errstate(all="ignore"):
        want = np.mod(x, y)
    sess = powerfusion.InferenceSession(_mod_model(elem, x.size).SerializeToString(), target=target)
    _assert_bit_equal(sess.run(None, {"x": x, "y": y})[0], want)


@pytest.mark.parametrize("dtype,elem", [(np.float32, T.FLOAT), (np.float64, T.DOUBLE)])
def test_cpu_session_float_mod_is_numpys(dtype, elem):
    _check_float_mod("cpu", dtype, elem)


def test_device_layout_keeps_rank_zero():
    from powerfusion.backends.cuda.session import _to_device_layout
    assert _to_device_layout(np.asarray(np.int64(15))).shape == ()


@pytest.mark.usefixtures("nvcc")
def test_emitted_cuda_float_mod_compiles():
    from powerfusion.backends.cuda.runtime import compile_check_nvcc
    from powerfusion.compiler import compile_model
    for elem in (T.FLOAT, T.DOUBLE):
        sources = [k.source for s in compile_model(_mod_model(elem, 64), "cuda").kernel_steps for k in s.kernels]
        assert sources and all("pf_floor_modf(" in s and "floorf" not in s for s in sources)
        for src in sources:
            compile_check_nvcc(src, "sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,elem", [(np.float32, T.FLOAT), (np.float64, T.DOUBLE)])
def test_cuda_float_mod_is_numpys(dtype, elem):
    _check_float_mod("cuda", dtype, elem)


@pytest.mark.gpu
def test_cuda_rank_zero_output_keeps_its_shape():
    import powerfusion
    got = powerfusion.InferenceSession(_size_model().SerializeToString(), target="cuda").run(
        None, {"x": np.zeros((3, 5), np.float32)})[0]
    assert got.shape == () and got.dtype == np.int64 and int(got) == 15


def test_float64_scalars_take_double_math():
    """A float64 operation is not computed through float32 libm calls or literals."""
    from powerfusion.backends.cstyle.renderer import double_precision
    from powerfusion.backends.cuda.renderer import CUDARenderer
    r = CUDARenderer()
    assert r.scalar("sigmoid", {}, ["a"], "float64") == "(1.0 / (1.0 + exp(-a)))"
    assert r.scalar("relu", {}, ["a"], "float64") == "(a < 0.0 ? 0.0 : a)"
    assert r.scalar("max", {}, ["a", "b"], "float64") == "pf_fmax(a, b)"
    assert r.scalar("floor_mod", {}, ["a", "b"], "float64") == "pf_floor_mod(a, b)"
    assert r.scalar("sqrt", {}, ["a"], "float32") == "sqrtf(a)"
    assert double_precision("isinf(x1f) + 2.5e-3f * powf(x, 1.f) + my_expf(y) + v0f") == \
        "isinf(x1f) + 2.5e-3 * pow(x, 1.) + my_expf(y) + v0f"


def _exp_sqrt_sigmoid_f64():
    g = h.make_graph([h.make_node("Sqrt", ["x"], ["s"]), h.make_node("Exp", ["s"], ["e"]),
                      h.make_node("Sigmoid", ["e"], ["z"])], "f64",
                     [h.make_tensor_value_info("x", T.DOUBLE, [64])], [h.make_tensor_value_info("z", T.DOUBLE, [64])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_float64_cuda_source_uses_double_math():
    from powerfusion.compiler import compile_model
    sources = [k.source for s in compile_model(_exp_sqrt_sigmoid_f64(), "cuda").kernel_steps for k in s.kernels]
    assert sources and not any(f in s for s in sources for f in ("sqrtf(", "expf(", "1.0f"))


def test_float64_cpu_kernels_compute_in_double():
    """sigmoid(exp(sqrt(x))) in float64 through the generated C agrees with numpy to double
    precision (through float32 math it was ~1e-8 off)."""
    import powerfusion
    x = np.linspace(0.01, 4.0, 64)
    got = powerfusion.InferenceSession(_exp_sqrt_sigmoid_f64().SerializeToString(), target="cpu").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-np.exp(np.sqrt(x)))), rtol=1e-13, atol=0)


@pytest.mark.gpu
def test_cuda_float64_kernels_compute_in_double():
    import powerfusion
    x = np.linspace(0.01, 4.0, 64)
    got = powerfusion.InferenceSession(_exp_sqrt_sigmoid_f64().SerializeToString(), target="cuda").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-np.exp(np.sqrt(x)))), rtol=1e-13, atol=0)
