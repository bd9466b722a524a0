"""Integer GEMMs of quantised MatMuls: the zero-point algebra (exact, int64 reference), which
models take the int8 x int8 -> int32 path, and that they still match onnxruntime (tolerances as
in test_qdq.py: QDQ one output step, dynamic relative 1e-5)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion.backends.cuda.int8_gemm import imma_blocker
from powerfusion.basic import MatMul
from powerfusion.frontend import import_model
from powerfusion.precision.integer_gemm import column_sums, correction
from powerfusion.session import InferenceSession

from .helpers import mlp, ort_run, rel_error
from .test_qdq import _ort_quantize, _output_step, _Stack

pytest.importorskip("onnxruntime.quantization")


@pytest.mark.parametrize("atype,shift", [(np.uint8, 128), (np.int8, 0)])
def test_zero_point_algebra_is_exact(atype, shift):
    rng = np.random.default_rng(0)
    info = np.iinfo(atype)
    a = rng.integers(info.min, info.max + 1, (7, 300), dtype=np.int64)
    w = rng.integers(-128, 128, (300, 33), dtype=np.int64).astype(np.int8)
    for z in (info.min, 0 if atype == np.int8 else 3, info.max):
        a8 = (a - shift).astype(np.int8)          # what the shifting kernel writes
        ours = a8.astype(np.int64) @ w.astype(np.int64) + correction(w, shift, z)
        np.testing.assert_array_equal(ours, (a - z) @ w.astype(np.int64))
    assert column_sums(np.full((4096, 2), -128, np.int8)).tolist() == [-128 * 4096] * 2


def test_imma_blocker_names_the_dimension():
    assert imma_blocker(128, 768, 768, False, False) is None
    assert imma_blocker(3, 8, 8, False, False) is None          # M is free
    assert "K=30" in imma_blocker(16, 64, 30, False, False)
    assert "ldc=10" in imma_blocker(16, 10, 64, False, False)
    assert "lda=6" in imma_blocker(6, 8, 8, True, False)


def _int8_matmuls(model) -> list:
    g = import_model(model)
    return [n for n in g.nodes if isinstance(n.op, MatMul) and g.tensors[n.inputs[0]].dtype == np.int8]


@pytest.mark.parametrize("per_channel", [False, True])
def test_static_qdq_matmul_runs_as_int8_gemm(per_channel):
    xs = np.random.default_rng(3).standard_normal((24, 16, 64)).astype(np.float32)
    q = _ort_quantize(mlp(k=64, m=16), True, "QDQ", per_channel, reader=_Stack(xs))
    assert len(_int8_matmuls(q)) == 2
    ours = InferenceSession(q).run(None, {"x": xs[0]})[0]
    ref = ort_run(q, {"x": xs[0]}, optimize=False)[0]
    assert np.abs(ours - ref).max() <= _output_step(q) * 1.001


def test_dynamic_matmul_integer_runs_as_int8_gemm():
    """uint8 activations with a run-time zero point: the correction term is computed at run time."""
    q = _ort_quantize(mlp(k=64, m=16), False)
    assert len(_int8_matmuls(q)) == 2
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    assert rel_error(InferenceSession(q).run(None, {"x": x})[0], ort_run(q, {"x": x})[0]) < 1e-5


def _matmul_integer_model(w: np.ndarray, w_zp) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(5, np.uint8), "az")]
    ins = ["a", "w", "az"]
    if w_zp is not None:
        inits.append(numpy_helper.from_array(np.array(w_zp, w.dtype), "wz"))
        ins.append("wz")
    node = helper.make_node("MatMulInteger", ins, ["y"])
    g = helper.make_graph([node], "mmi", [helper.make_tensor_value_info("a", TensorProto.UINT8, [8, w.shape[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [8, w.shape[1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("wdtype,w_zp,int8_path", [(np.int8, None, True), (np.int8, 0, True),
                                                    (np.int8, 3, False), (np.uint8, 128, False)])
def test_matmul_integer_exact_on_either_path(wdtype, w_zp, int8_path):
    """Only a constant int8 weight with zero point 0 takes the integer GEMM; every form is exact."""
    rng = np.random.default_rng(2)
    info = np.iinfo(wdtype)
    w = rng.integers(info.min, info.max + 1, (32, 24)).astype(wdtype)
    model = _matmul_integer_model(w, w_zp)
    assert bool(_int8_matmuls(model)) == int8_path
    a = rng.integers(0, 256, (8, 32)).astype(np.uint8)
    ref = (a.astype(np.int64) - 5) @ (w.astype(np.int64) - (w_zp or 0))
    np.testing.assert_array_equal(InferenceSession(model).run(None, {"a": a})[0], ref)


def _int8_convs(model, shapes=None) -> list:
    from powerfusion.basic import Conv
    g = import_model(model, shapes)
    return [n for n in g.nodes if isinstance(n.op, Conv) and g.tensors[n.inputs[0]].dtype == np.int8]


def _reference_conv(x, w, pads, stride, zp):
    """ConvInteger by definition: (x - zp) zero-padded, correlated with w, in int64."""
    xp = np.pad(x.astype(np.int64) - zp, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    m, _, kh, kw = w.shape
    oh, ow = (xp.shape[2] - kh) // stride + 1, (xp.shape[3] - kw) // stride + 1
    out = np.zeros((x.shape[0], m, oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            out += np.einsum("nchw,mc->nmhw", patch, w[:, :, i, j].astype(np.int64))
    return out


@pytest.mark.parametrize("xdtype,zp", [(np.uint8, 7), (np.int8, -3), (np.uint8, None)])
def test_conv_integer_with_padding_is_exact(xdtype, zp):
    """Padding must contribute (zp - zp) = 0: x is padded with its zero point before the shift."""
    rng = np.random.default_rng(4)
    info = np.iinfo(xdtype)
    x = rng.integers(info.min, info.max + 1, (2, 5, 9, 9)).astype(xdtype)
    w = rng.integers(-128, 128, (6, 5, 3, 3)).astype(np.int8)
    pads, ttype = [1, 2, 1, 0], TensorProto.UINT8 if xdtype == np.uint8 else TensorProto.INT8
    inits = [numpy_helper.from_array(w, "w")]
    if zp is not None:
        inits.append(numpy_helper.from_array(np.array(zp, xdtype), "xz"))
    node = helper.make_node("ConvInteger", ["x", "w"] + (["xz"] if zp is not None else []), ["y"],
                            pads=pads, strides=[2, 2])
    ref = _reference_conv(x, w, pads, 2, zp or 0)
    g = helper.make_graph([node], "ci", [helper.make_tensor_value_info("x", ttype, list(x.shape))],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, list(ref.shape))], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert len(_int8_convs(model)) == 1
    np.testing.assert_array_equal(InferenceSession(model).run(None, {"x": x})[0], ref)


def test_static_qdq_cnn_runs_int8_convs():
    from .helpers import digits, digits_data
    q = _ort_quantize(digits("digits_cnn"), True, "QDQ", True)
    x = digits_data()["x_test"][:16]
    assert len(_int8_convs(q, {"image": x.shape})) >= 1
    ours = InferenceSession(q, shapes={"image": x.shape}).run(None, {"image": x})[0]
    assert np.abs(ours - ort_run(q, {"image": x}, optimize=False)[0]).max() <= _output_step(q) * 1.001


def _requantize_chain(second_scale: float) -> onnx.ModelProto:
    """x -> Q -> DQ -> Reshape -> Q -> DQ -> Transpose -> y, the second pair at `second_scale`."""
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s1"),
             numpy_helper.from_array(np.array(second_scale, np.float32), "s2"),
             numpy_helper.from_array(np.array(3, np.int8), "z"),
             numpy_helper.from_array(np.array([2, 12, 8], np.int64), "shape")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["q1"]),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"]),
             helper.make_node("Reshape", ["d1", "shape"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
             helper.make_node("Transpose", ["d2"], ["y"], perm=[0, 2, 1])]
    g = helper.make_graph(nodes, "rq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 96])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 12])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("second_scale,dropped", [(0.05, True), (0.07, False)])
def test_redundant_requantize_pairs_are_dropped_exactly(second_scale, dropped):
    from powerfusion.precision.requantize import drop_requantize_pairs
    model = _requantize_chain(second_scale)
    x = (np.random.default_rng(6).standard_normal((2, 96)) * 4).astype(np.float32)   # saturates some
    ref = ort_run(model, {"x": x}, optimize=False)[0]
    simplified = drop_requantize_pairs(onnx.ModelProto.FromString(model.SerializeToString()))
    quantizes = sum(n.op_type == "QuantizeLinear" for n in simplified.graph.node)
    assert quantizes == (1 if dropped else 2)
    np.testing.assert_array_equal(ort_run(simplified, {"x": x}, optimize=False)[0], ref)
    np.testing.assert_array_equal(InferenceSession(model).run(None, {"x": x})[0], ref)
