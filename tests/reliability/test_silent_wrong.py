"""Results that used to be silently wrong: colliding names, clamped indices, integer division
by zero, log-sum-exp of infinities, outputs aliasing the session's constants."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

import powerfusion
import powerfusion.cli as cli
from powerfusion.errors import DataError, NodeError
from powerfusion.names import FileNames, buffer_names


def _model(nodes, inputs, outputs, inits=()):
    g = h.make_graph(nodes, "m", inputs, outputs, list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _vi(name, dtype, shape):
    return h.make_tensor_value_info(name, dtype, shape)


def _both(model, feeds):
    ours = powerfusion.InferenceSession(model.SerializeToString()).run(None, feeds)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return ours, ref


@pytest.mark.parametrize("names", [("sg0_a", "t_sg0_a"), ("sg0_0", "t_sg0_0", "tt_sg0_0"), ("a.b", "a_b", "a-b")])
def test_inputs_named_like_prefixed_buffers_stay_apart(names):
    nodes, prev = [], names[0]
    for k, n in enumerate(names[1:]):
        nodes.append(h.make_node("Mul", [prev, n], [f"p{k}"]))
        prev = f"p{k}"
    model = _model(nodes + [h.make_node("Relu", [prev], ["y"])], [_vi(n, T.FLOAT, [2]) for n in names],
                   [_vi("y", T.FLOAT, [2])])
    feeds = {n: np.full(2, k + 2, np.float32) for k, n in enumerate(names)}
    ours, ref = _both(model, feeds)
    np.testing.assert_array_equal(ours[0], ref[0])   # small integers in float32: exact


def test_buffer_names_avoid_the_reserved_namespace_and_each_other():
    names = buffer_names(["sg0_a", "t_sg0_a", "t_sg0_a_1", "x"], reserved="sg0_")
    assert len(set(names.values())) == 4
    assert not any(v.startswith("sg0_") for v in names.values())


def test_file_names_are_distinct_short_and_case_free():
    f = FileNames()
    names = [f.file(k, s, ".npy") for k, s in enumerate(["W.1", "W_1", "W-1", "w_1", "x" * 400, "x" * 401])]
    assert len({n.lower() for n in names}) == len(names)
    assert max(len(n) for n in names) <= FileNames.MAX_FILE_CHARS
    assert f.file(0, "W.1", ".npy") == names[0]      # one name per key


def test_compile_keeps_weights_whose_names_sanitise_alike(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERFUSION_CACHE_DIR", str(tmp_path / "cache"))
    names, nodes, inits, prev = ["W.1", "W_1", "W-1"], [], [], "x"
    for k, n in enumerate(names):
        nodes.append(h.make_node("MatMul", [prev, n], [f"y{k}"]))
        inits.append(nh.from_array(np.full((64, 64), k + 1, np.float32), n))
        prev = f"y{k}"
    path = tmp_path / "w.onnx"
    onnx.save(_model(nodes, [_vi("x", T.FLOAT, [64, 64])], [_vi(prev, T.FLOAT, [64, 64])], inits), path)
    out = tmp_path / "out"
    with powerfusion.options.context(cache_dir=tmp_path / "cache"):
        assert cli.main(["-q", "compile", str(path), "-o", str(out), "--no-cache"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    for k, n in enumerate(names):
        np.testing.assert_array_equal(np.load(out / plan["tensors"][n]["file"]), np.full((64, 64), k + 1, np.float32))


def _gather_model(indices=None):
    nodes = [h.make_node("Gather", ["x", "i"], ["g"], axis=0), h.make_node("Relu", ["g"], ["y"])]
    inputs = [_vi("x", T.FLOAT, [4, 3])] + ([] if indices is not None else [_vi("i", T.INT64, [2])])
    inits = [nh.from_array(np.array(indices, np.int64), "i")] if indices is not None else []
    return _model(nodes, inputs, [_vi("y", T.FLOAT, [2, 3])], inits)


def test_out_of_range_gather_indices_are_refused():
    sess = powerfusion.InferenceSession(_gather_model().SerializeToString())
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    ours = sess.run(None, {"x": x, "i": np.array([3, -4])})[0]
    np.testing.assert_array_equal(ours, x[[3, 0]])
    for bad in ([4, 0], [0, -5]):
        with pytest.raises(DataError, match="Gather_0.*out of range"):
            sess.run(None, {"x": x, "i": np.array(bad)})
    with pytest.raises(NodeError, match="constant index 7 is out of range"):
        powerfusion.InferenceSession(_gather_model([1, 7]).SerializeToString())


def test_integer_division_truncates_and_refuses_zero():
    model = _model([h.make_node("Div", ["a", "b"], ["y"])], [_vi("a", T.INT64, [4]), _vi("b", T.INT64, [4])],
                   [_vi("y", T.INT64, [4])])
    a, b = np.array([7, -7, 2**62 + 1, -(2**62) - 1]), np.array([2, 2, 3, 3])
    ours, ref = _both(model, {"a": a, "b": b})
    np.testing.assert_array_equal(ours[0], ref[0])
    with pytest.raises(DataError, match="division by zero"):
        powerfusion.InferenceSession(model.SerializeToString()).run(None, {"a": a, "b": np.array([2, 0, 3, 3])})


def test_reduce_log_sum_exp_of_infinities():
    model = _model([h.make_node("ReduceLogSumExp", ["x"], ["y"], axes=[1], keepdims=0)], [_vi("x", T.FLOAT, [3, 4])],
                   [_vi("y", T.FLOAT, [3])])
    x = np.array([[1, 2, np.inf, 0], [-np.inf] * 4, [1, 2, 3, 4]], np.float32)
    ours, ref = _both(model, {"x": x})
    # float32 log/exp: rtol 1e-6 on the finite row; infinities exactly
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)


def test_outputs_never_alias_the_sessions_constants():
    c = nh.from_array(np.arange(4, dtype=np.float32), "c")
    model = _model([h.make_node("Identity", ["x"], ["y"])], [_vi("x", T.FLOAT, [4])],
                   [_vi("y", T.FLOAT, [4]), _vi("c", T.FLOAT, [4])], [c])
    sess = powerfusion.InferenceSession(model.SerializeToString())
    x = np.ones(4, np.float32)
    y, const = sess.run(None, {"x": x})
    const[:] = -1
    y[:] = -1
    assert np.array_equal(x, np.ones(4, np.float32))
    np.testing.assert_array_equal(sess.run(None, {"x": x})[1], np.arange(4, dtype=np.float32))


def test_a_feed_that_is_not_a_mapping_is_a_feed_error():
    sess = powerfusion.InferenceSession(_gather_model().SerializeToString())
    with pytest.raises(powerfusion.errors.FeedError, match="input_feed must be a dict"):
        sess.run(None, None)
