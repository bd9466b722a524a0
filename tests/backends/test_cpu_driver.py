"""The cpu target's whole-model driver (backends/cpu/driver.py): runs of steps in one C call.

The driver's outputs are compared with the per-step path (the same kernels, library ops
through numpy) and with the cpu-reference target (the fast GIR executor, checked against
the interpreter in tests/gir). Tolerance: 1e-5 of each output's largest magnitude (the C
GEMMs split rows over threads and im2col orders the sums as numpy's does, so differences are
summation order only); integer outputs exactly.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion import InferenceSession
from powerfusion.backends.cpu.driver import Driver, numpy_blas
from powerfusion.errors import DataError
from tests.session_cases import small_model_names, small_model_session

TOL = 1e-5


def assert_close(got: list, want: list, label: str) -> None:
    for k, (x, w) in enumerate(zip(got, want)):
        assert x.dtype == w.dtype and x.shape == w.shape, f"{label} output {k}"
        if w.dtype.kind != "f":
            np.testing.assert_array_equal(x, w, err_msg=f"{label} output {k}")
            continue
        scale = max(float(np.max(np.abs(w), initial=0.0)), 1.0)
        err = float(np.max(np.abs(x.astype(np.float64) - w), initial=0.0)) / scale
        assert err < TOL, f"{label} output {k}: error {err:.2e} of {scale:.2e}"


def per_step(sess: InferenceSession, feeds: dict) -> list:
    """The session's outputs with the driver turned off (each step called from Python)."""
    plan = sess.cpu_plan
    try:
        sess.cpu_plan = dataclasses.replace(plan, pieces=None)
        return sess.run(None, feeds)
    finally:
        sess.cpu_plan = plan


def test_numpy_blas_is_found():
    assert numpy_blas() is not None, "numpy's OpenBLAS exposes no CBLAS GEMM: library ops stay on numpy"


@pytest.mark.parametrize("name", small_model_names())
def test_driver_matches_per_step_path_and_reference(name):
    sess, feeds = small_model_session(name)
    assert not sess.cpu_plan.left_out, sess.cpu_plan.left_out
    assert any(isinstance(p, Driver) for p in sess.cpu_plan.pieces)
    got = sess.run(None, feeds)
    assert_close(got, per_step(sess, feeds), f"{name} driver vs per-step")
    ref, _ = small_model_session(name, "cpu-reference")
    assert_close(got, ref.run(None, feeds), f"{name} driver vs cpu-reference")
    again = sess.run(None, feeds)   # reused buffers give the same result; outputs are fresh arrays
    assert_close(again, got, f"{name} second run")
    assert all(a is not b for a, b in zip(again, got))
    assert [n for n, _ in sess.profile] == [getattr(s, "name", None) or s.node.name for s in sess.partition.steps]


def conv_model(x_shape, w_shape, strides, pads, dilations, group, bias: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "W")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "B"))
    node = helper.make_node("Conv", ["x", "W"] + (["B"] if bias else []), ["y"], strides=list(strides),
                            pads=list(pads), dilations=list(dilations), group=group)
    relu = helper.make_node("Relu", ["y"], ["z"])
    nsp = len(x_shape) - 2
    out = [x_shape[0], w_shape[0]] + [(x_shape[2 + i] + pads[i] + pads[nsp + i] - dilations[i] * (w_shape[2 + i] - 1) - 1)
                                      // strides[i] + 1 for i in range(nsp)]
    graph = helper.make_graph([node, relu], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, out)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("x_shape,w_shape,strides,pads,dilations,group,bias", [
    ((1, 16, 7, 7), (8, 16, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, True),        # 1x1: a plain GEMM
    ((2, 8, 9, 9), (8, 1, 3, 3), (2, 1), (1, 1, 1, 1), (1, 1), 8, True),          # depthwise, strided, padded
    ((1, 8, 6, 7), (8, 1, 5, 3), (1, 2), (2, 0, 2, 1), (2, 1), 8, False),         # depthwise, dilated, uneven
    ((2, 6, 14, 13), (6, 1, 5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 6, True),        # depthwise, padded
    ((1, 5, 9, 11), (5, 1, 3, 5), (1, 1), (0, 2, 1, 1), (1, 1), 5, False),        # depthwise, uneven pads
    # depthwise phase planes: stride 2 with odd and even left pads, stride 3 (the general column
    # split), stride with dilation (taps in several phases), a window wider than the input, pads
    # wider than the window (rows and columns that read only padding), ends cut by the stride
    ((1, 7, 12, 13), (7, 1, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 7, True),
    ((1, 7, 12, 13), (7, 1, 4, 4), (2, 2), (0, 2, 1, 0), (1, 1), 7, False),
    ((1, 3, 17, 16), (3, 1, 3, 5), (3, 3), (1, 2, 2, 1), (1, 1), 3, True),
    ((1, 4, 15, 14), (4, 1, 3, 3), (2, 3), (2, 3, 2, 3), (2, 3), 4, True),
    ((1, 3, 4, 3), (3, 1, 5, 5), (1, 2), (2, 2, 2, 2), (1, 1), 3, True),
    ((1, 2, 3, 3), (2, 1, 2, 2), (2, 2), (5, 4, 3, 6), (1, 1), 2, True),
    ((1, 6, 10, 8), (9, 2, 3, 2), (1, 2), (2, 0, 1, 1), (2, 1), 3, True),         # grouped, dilated, uneven pads
    ((1, 4, 8, 8), (8, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4, False),         # depth multiplier 2
    # direct over phase planes beyond depthwise: outputs of one input channel share its planes
    # (two images: the planes held must be the right image's), or several inputs accumulate
    ((2, 1, 21, 19), (16, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True),       # one input channel
    ((2, 3, 13, 11), (9, 1, 5, 3), (2, 1), (2, 1, 1, 0), (1, 2), 3, True),        # depth multiplier 3, strided
    ((1, 12, 10, 9), (6, 4, 3, 3), (2, 2), (1, 1, 0, 1), (1, 1), 3, False),       # 2 outputs of 4 inputs a group
    ((1, 64, 7, 7), (128, 32, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2, True),      # few blocks: the GEMM split
    ((2, 16, 64, 60), (16, 8, 3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 2, False),     # tiled im2col, dilated
    ((1, 16, 33, 31), (24, 8, 3, 3), (2, 2), (1, 0, 1, 2), (1, 1), 2, True),      # tiled, strided, uneven
    # implicit GEMM over phase planes (one group, a window of more than one tap): output channels
    # not a whole panel, two images, dilation, strides (4 and 2 phases), uneven pads
    ((1, 64, 28, 28), (128, 64, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True),
    ((2, 16, 64, 60), (20, 16, 3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1, False),
    ((1, 16, 65, 61), (13, 16, 3, 3), (2, 2), (1, 0, 1, 2), (1, 1), 1, True),
    ((1, 3, 80, 76), (13, 3, 7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1, True),
    ((2, 5, 23, 30), (9, 5, 3, 2), (1, 2), (0, 1, 2, 0), (2, 1), 1, True),
    # its form along output channels (small planes): panels of 48 channels, one whole, one not;
    # the last group of 8 positions partial; strided, dilated, two images
    ((1, 20, 7, 7), (50, 20, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True),
    ((2, 6, 14, 13), (100, 6, 3, 3), (2, 2), (1, 1, 0, 1), (1, 1), 1, True),
    ((1, 9, 11, 10), (17, 9, 3, 5), (1, 2), (2, 2, 2, 2), (2, 1), 1, False),
    ((1, 16, 20, 20), (1, 16, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True),      # one output channel: direct
    ((2, 20, 30, 29), (20, 1, 5, 5), (2, 2), (2, 1, 2, 2), (1, 1), 20, True),     # depthwise, two images
    ((1, 40, 120, 120), (40, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 40, True),   # depthwise, threaded
    ((1, 17, 90, 47), (17, 1, 3, 3), (1, 2), (0, 1, 2, 0), (2, 1), 17, False),    # depthwise, dilated, uneven pads
    # taps wholly right of the input (dilation > width, DeepLabV3's ASPP at rate 36 on 14x14):
    # their im2col rows are all zero and must write nothing before them
    ((1, 32, 64, 16), (64, 32, 1, 3), (1, 1), (0, 400, 0, 400), (1, 400), 1, True),   # tiled
    ((1, 64, 14, 14), (32, 64, 3, 3), (1, 1), (36, 36, 36, 36), (36, 36), 1, True),   # few blocks
    ((1, 8, 14, 14), (16, 4, 3, 3), (2, 1), (24, 30, 24, 30), (24, 30), 2, False),    # grouped, strided
])
def test_driver_conv_matches_onnxruntime(x_shape, w_shape, strides, pads, dilations, group, bias):
    import onnxruntime as ort
    model = conv_model(x_shape, w_shape, strides, pads, dilations, group, bias)
    sess = InferenceSession(model)
    assert not sess.cpu_plan.left_out and isinstance(sess.cpu_plan.pieces[0], Driver)
    # each case keeps the path its comment names: the implicit GEMM for one group, a window of
    # several taps and more than 4 outputs from several inputs -- along output channels where
    # most positions of a strip would be dropped (small planes, dilations wider than the plane) --
    # and im2col otherwise
    implicit = group == 1 and w_shape[2] * w_shape[3] > 1 and w_shape[0] > 4 and x_shape[1] > 1
    small = x_shape[2:] in ((7, 7), (11, 10), (14, 13)) or max(dilations) >= 36
    fn = ("pf_igemmc_f32(" if small else "pf_igemm_f32(") if implicit else "pf_conv2d_f32("
    assert sess.cpu_plan.pieces[0].source_lines[0].startswith(fn)
    x = np.random.default_rng(8).standard_normal(x_shape).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert_close(sess.run(None, {"x": x}), want, "conv")


@pytest.mark.parametrize("x_shape,w_shape,strides,pads,fn", [
    ((1, 6, 11, 12), (6, 1, 3, 3), (2, 1), (1, 1, 1, 1), "pf_conv2d_f64"),   # direct over phase planes
    ((1, 5, 30, 29), (11, 5, 3, 3), (1, 1), (1, 0, 1, 2), "pf_igemm_f64"),   # along positions
    ((1, 5, 7, 7), (11, 5, 3, 3), (2, 2), (1, 1, 1, 1), "pf_igemmc_f64"),    # along output channels
])
def test_driver_conv_float64_matches_float64_numpy(x_shape, w_shape, strides, pads, fn):
    """float64 convolutions (vectors of 8) against numpy in float64, to float64 rounding."""
    model = conv_model(x_shape, w_shape, strides, pads, (1, 1), x_shape[1] if w_shape[1] == 1 else 1, True)
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    sess = InferenceSession(model)
    assert sess.cpu_plan.pieces[0].source_lines[0].startswith(fn + "(")
    x = np.random.default_rng(8).standard_normal(x_shape)
    w = numpy_helper.to_array(model.graph.initializer[0])
    bias = numpy_helper.to_array(model.graph.initializer[1])
    group = x_shape[1] // w_shape[1]
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (xp.shape[2] - w_shape[2]) // strides[0] + 1
    ow = (xp.shape[3] - w_shape[3]) // strides[1] + 1
    want = np.zeros((1, w_shape[0], oh, ow)) + bias[None, :, None, None]
    mg, cg = w_shape[0] // group, w_shape[1]
    for o in range(w_shape[0]):
        for ci in range(cg):
            for ki in range(w_shape[2]):
                for kj in range(w_shape[3]):
                    win = xp[0, (o // mg) * cg + ci, ki:ki + strides[0] * oh:strides[0], kj:kj + strides[1] * ow:strides[1]]
                    want[0, o] += w[o, ci, ki, kj] * win
    got = sess.run(None, {"x": x})[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, np.maximum(want, 0.0), rtol=1e-12, atol=1e-12)


def matmul_model(a_shape, b_shape, weight: bool) -> onnx.ModelProto:
    b = numpy_helper.from_array(np.random.default_rng(9).standard_normal(b_shape).astype(np.float32), "b")
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)]
    if not weight:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape))
    out = list(np.broadcast_shapes(a_shape[:-2], b_shape[:-2])) + [a_shape[-2], b_shape[-1]]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "mm", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], [b] if weight else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("a_shape,b_shape,weight", [
    ((3, 40), (40, 24), True), ((2, 5, 64), (64, 300), True),      # a weight: the batch folds into M
    ((4, 64, 8), (4, 8, 130), False), ((3, 1, 5, 6), (1, 2, 6, 7), False),   # batched, broadcast
    ((200, 64), (64, 300), False)])                                 # split over threads
def test_driver_matmul_matches_numpy(a_shape, b_shape, weight):
    model = matmul_model(a_shape, b_shape, weight)
    sess = InferenceSession(model)
    assert not sess.cpu_plan.left_out
    rng = np.random.default_rng(10)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32)}
    b = numpy_helper.to_array(model.graph.initializer[0]) if weight else rng.standard_normal(b_shape).astype(np.float32)
    if not weight:
        feeds["b"] = b
    want = np.matmul(feeds["a"].astype(np.float64), b.astype(np.float64)).astype(np.float32)
    assert_close(sess.run(None, feeds), [want], "matmul")


def test_one_dimensional_conv_is_left_to_numpy_and_said_why():
    model = conv_model((2, 4, 11), (6, 4, 3), (2,), (1, 2), (1,), 1, True)
    sess = InferenceSession(model)
    assert any("2-D" in why for why in sess.cpu_plan.left_out.values()), sess.cpu_plan.left_out
    x = np.random.default_rng(11).standard_normal((2, 4, 11)).astype(np.float32)
    assert_close(sess.run(None, {"x": x}), per_step(sess, {"x": x}), "conv1d")


def test_gather_indices_from_a_feed_are_checked_before_the_run():
    data = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "E")
    graph = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["g"], axis=0),
                               helper.make_node("Relu", ["g"], ["y"])], "gather",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [data])
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert isinstance(sess.cpu_plan.pieces[0], Driver)
    np.testing.assert_array_equal(sess.run(None, {"ids": np.array([3, -4])})[0], [[9, 10, 11], [0, 1, 2]])
    with pytest.raises(DataError, match="index 4"):
        sess.run(None, {"ids": np.array([0, 4])})


def test_outputs_that_are_constants_or_feeds_are_copies():
    """An output that is a constant (or a view of one) or a feed is returned as a copy: changing
    it must not change later runs; fresh outputs the run made are returned as they are."""
    const = numpy_helper.from_array(np.arange(6, dtype=np.float32), "C")
    shape = numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "S")
    graph = helper.make_graph([helper.make_node("Reshape", ["C", "S"], ["c"]),
                               helper.make_node("Identity", ["x"], ["i"]),
                               helper.make_node("Relu", ["x"], ["r"])], "own",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "cir"], [const, shape])
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    x = np.full((2, 3), -1.0, np.float32)
    c, i, r = sess.run(None, {"x": x})
    c[:] = 7
    i[:] = 7
    np.testing.assert_array_equal(x, -1.0)
    c2, i2, r2 = sess.run(None, {"x": x})
    np.testing.assert_array_equal(c2, np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(r2, 0.0)
    assert r2 is not r


def _unary_model(op: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 3])
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], f"one_{op.lower()}", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_runs_of_the_same_text_keep_their_own_kernels():
    """Two runs whose generated C is the same text (one kernel, one input, one output) share
    one cached shared object; each must still call its own kernel, whichever was bound last,
    within a session (split by a step left to Python) and across sessions."""
    x = np.random.default_rng(5).uniform(-1, 1, (2, 3, 3)).astype(np.float32)
    relu = InferenceSession(_unary_model("Relu"), target="cpu")
    exp = InferenceSession(_unary_model("Exp"), target="cpu")
    np.testing.assert_allclose(relu.run(None, {"x": x})[0], np.maximum(x, 0), rtol=1e-6)
    np.testing.assert_allclose(exp.run(None, {"x": x})[0], np.exp(x), rtol=1e-6)

    pytest.importorskip("onnxruntime")
    xt = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])
    yt = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Det", ["r"], ["d"], name="the_det"),
             helper.make_node("Exp", ["d"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "relu_det_exp", [xt], [yt]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(Warning):
        sess = InferenceSession(model, target="cpu", options={"fallback": "onnxruntime"})
    xp = np.abs(x) + 0.1
    want = np.exp(np.linalg.det(xp.astype(np.float64)))
    np.testing.assert_allclose(sess.run(None, {"x": xp})[0], want, rtol=1e-5)
