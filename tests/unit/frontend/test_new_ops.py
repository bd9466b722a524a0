"""New ops and the shape arithmetic of swin/maxvit-like graphs, against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.frontend.fe_helpers import check, make_model
from powerfusion.errors import UnsupportedOpError
from powerfusion.frontend import import_model

RNG = np.random.default_rng(5)
X = RNG.standard_normal((2, 3, 4, 6)).astype(np.float32)


@pytest.mark.parametrize("equation, shapes", [
    ("bhid,bhjd->bhij", [(2, 3, 4, 5), (2, 3, 6, 5)]),      # maxvit attention scores
    ("bhij,bhjd->bhid", [(2, 3, 4, 6), (2, 3, 6, 5)]),      # maxvit attention output
    ("ij,jk", [(3, 4), (4, 5)]),                            # implicit output
    ("...ii->...i", [(2, 3, 3)]),                           # diagonal with an ellipsis
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),             # three operands
    ("bij->b", [(2, 3, 4)]),                                # a sum
])
def test_einsum(equation, shapes):
    feeds = {f"x{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    check(make_model("Einsum", feeds, attrs={"equation": equation}), feeds)


@pytest.mark.parametrize("op, attrs", [("ArgMax", {"axis": 1}), ("ArgMin", {"axis": -1, "keepdims": 0}),
                                       ("ArgMax", {"axis": 2, "select_last_index": 1})])
def test_arg_extremes(op, attrs):
    x = np.round(X * 2) / 2   # ties, so that first/last index matters
    check(make_model(op, {"x": x}, attrs=attrs), {"x": x})


def test_cumsum_exclusive_reverse():
    check(make_model("CumSum", {"x": X}, {"axis": np.array(2, np.int64)}, attrs={"exclusive": 1, "reverse": 1}),
          {"x": X})


def test_scatter_nd_with_constant_indices():
    idx = np.array([[0, 1], [1, 2], [0, 1]], np.int64)   # a repeated index: the last write wins
    upd = RNG.standard_normal((3, 4, 6)).astype(np.float32)
    check(make_model("ScatterND", {"x": X, "u": upd}, {"i": idx}, inputs=["x", "i", "u"]), {"x": X, "u": upd})


def test_gather_nd_with_run_time_indices():
    idx = np.array([[[0, 1], [1, -1]]], np.int64)
    feeds = {"x": X, "i": idx}
    check(make_model("GatherND", feeds, attrs={"batch_dims": 0}), feeds)


@pytest.mark.parametrize("attrs, scales", [
    ({"mode": "nearest"}, [1, 1, 2, 2]),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, [1, 1, 1.5, 0.5]),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, [1, 1, 2, 2]),
])
def test_resize(attrs, scales):
    consts = {"roi": np.array([], np.float32), "scales": np.array(scales, np.float32)}
    check(make_model("Resize", {"x": X}, consts, attrs=attrs, opset=13), {"x": X})


def test_mod_floor_and_truncated():
    a = np.array([-7, 7, -7, 5], np.int64)
    b = np.array([3, -3, -3, 5], np.int64)
    feeds = {"a": a, "b": b}
    check(make_model("Mod", feeds), feeds)
    check(make_model("Mod", feeds, attrs={"fmod": 1}), feeds)


def test_rms_normalization_expanded_from_its_function_body():
    x = RNG.standard_normal((2, 5, 8)).astype(np.float32)
    scale = RNG.standard_normal(8).astype(np.float32)
    model = make_model("RMSNormalization", {"x": x}, {"s": scale}, attrs={"epsilon": 1e-5}, opset=23)
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale
    check(model, {"x": x}, reference={"y": want.astype(np.float32)})


def _swin_mask_model():
    """The shifted-window mask of torchvision's swin: Shape -> Mod -> Range -> ScatterND into a
    ConstantOfShape, then the mask is added to the input; all of it depends on shapes only."""
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "two"], ["h"], axis=0),
        helper.make_node("Mod", ["h", "three"], ["hm"]),                   # 4 % 3 = 1
        helper.make_node("Range", ["zero", "h", "one"], ["rows"]),         # 0..3
        helper.make_node("Unsqueeze", ["rows", "ax1"], ["rows2"]),
        helper.make_node("Slice", ["rows2", "hm_start", "end"], ["picked"]),   # rows 1..3
        helper.make_node("Gather", ["s", "three_idx"], ["w"], axis=0),
        helper.make_node("Unsqueeze", ["h", "ax0"], ["h1"]),
        helper.make_node("Unsqueeze", ["w", "ax0"], ["w1"]),
        helper.make_node("Concat", ["h1", "w1"], ["hw"], axis=0),
        helper.make_node("ConstantOfShape", ["hw"], ["zeros"],
                         value=helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Expand", ["val", "upd_shape"], ["upd"]),
        helper.make_node("ScatterND", ["zeros", "picked", "upd"], ["mask"]),
        helper.make_node("Equal", ["mask", "zero_f"], ["is0"]),
        helper.make_node("Where", ["is0", "zero_f", "neg"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["y"]),
    ]
    consts = {"two": i64(2), "three": i64(3), "zero": i64(0), "one": i64(1), "ax1": i64([1]), "ax0": i64([0]),
              "hm_start": i64([1]), "end": i64([4]), "three_idx": i64(3), "val": np.array(1.0, np.float32),
              "upd_shape": i64([3, 6]), "zero_f": np.array(0.0, np.float32), "neg": np.array(-100.0, np.float32)}
    return make_model(None, {"x": X}, consts, nodes=nodes)


def test_swin_mask_arithmetic_folds_before_conversion():
    model = _swin_mask_model()
    graph = check(model, {"x": X})
    assert {n.origin.op_type for n in graph.nodes} == {"Add"}


def test_unsupported_report_counts_op_types_first():
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Det", ["x"], ["d"]),
             helper.make_node("Det", ["x"], ["d2"])]
    x = np.ones((2, 3, 3), np.float32)
    with pytest.raises(UnsupportedOpError) as e:
        import_model(make_model(None, {"x": x}, nodes=nodes, outputs=("nz", "d", "d2")))
    first = str(e.value).splitlines()[0]
    assert first == "3 unsupported node(s) of 2 op type(s): Det x2, NonZero x1"


def _det_model():
    x = RNG.standard_normal((2, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Det", ["r"], ["d"], name="the_det"),
             helper.make_node("Exp", ["d"], ["y"])]
    return make_model(None, {"x": x}, nodes=nodes), x


def test_fallback_runs_unsupported_nodes_through_onnxruntime_and_says_which():
    from powerfusion.frontend.fallback import FallbackWarning
    from powerfusion.session import InferenceSession
    from tests.frontend.fe_helpers import run_ort
    model, x = _det_model()
    with pytest.raises(UnsupportedOpError, match="Det x1"):
        InferenceSession(model, target="cpu")
    with pytest.warns(FallbackWarning, match=r"1 node\(s\) run through onnxruntime.*Det x1: 'the_det'"):
        session = InferenceSession(model, target="cpu", options={"fallback": "onnxruntime"})
    got = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, run_ort(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    library = [s.node.op.op_type for s in session.partition.library_calls]
    assert library == ["Det"]


def test_unknown_fallback_is_an_error():
    from powerfusion.errors import PowerFusionError
    model, _ = _det_model()
    with pytest.raises(PowerFusionError, match="unknown fallback 'tvm'"):
        import_model(model, fallback="tvm")


def test_cli_run_with_fallback(tmp_path, capsys):
    from powerfusion.cli import main
    model, _ = _det_model()
    path = tmp_path / "det.onnx"
    onnx.save(model, path)
    with pytest.warns(UserWarning, match="Det x1"):
        assert main(["run", str(path), "--fallback", "onnxruntime"]) == 0
    assert "1 output(s)" in capsys.readouterr().out


def _dynamic_attention_model():
    """A bert-like attention block exported with dynamic [batch, seq] axes: its Reshape target is
    computed from Shape at run time, and the mask shares the ids' symbols."""
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
        helper.make_node("Shape", ["emb"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["b1", "n1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["emb", "target"], ["q"]),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["q"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["qt", "kt"], ["scores"]),
        helper.make_node("Cast", ["attention_mask"], ["mf"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mf", "ax12"], ["m4"]),
        helper.make_node("Sub", ["onef", "m4"], ["inv"]),
        helper.make_node("Mul", ["inv", "big"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "qt"], ["y"]),
    ]
    consts = {"table": RNG.standard_normal((50, 8)).astype(np.float32), "zero": i64(0), "one": i64(1),
              "ax0": i64([0]), "heads": i64([2, 4]), "ax12": i64([1, 2]), "onef": np.array(1.0, np.float32),
              "big": np.array(-1e4, np.float32)}
    inputs = [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "seq"])]
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "bert_like", inputs, [helper.make_tensor_value_info("y", 1, ["batch", 2, "seq", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_dynamic_axes_bound_by_one_input_shape():
    from powerfusion.errors import ModelError
    from powerfusion.session import InferenceSession
    from tests.frontend.fe_helpers import run_ort
    model = _dynamic_attention_model()
    feeds = {"input_ids": RNG.integers(0, 50, (1, 64)).astype(np.int64),
             "attention_mask": (RNG.random((1, 64)) > 0.2).astype(np.int64)}
    session = InferenceSession(model, target="cpu", shapes="input_ids:1x64")
    assert [i.shape for i in session.get_inputs()] == [[1, 64], [1, 64]]
    np.testing.assert_allclose(session.run(None, feeds)[0], run_ort(model, feeds)["y"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelError, match="symbol 'seq' is 64 in input_ids:1x64 but 32 in attention_mask:1x32"):
        InferenceSession(model, target="cpu", shapes="input_ids:1x64,attention_mask:1x32")


@pytest.mark.parametrize("largest", [1, 0])
def test_top_k_ties_go_to_the_lower_index(largest):
    x = np.array([[3, 1, 3, 2, 1, 3], [0, 0, 5, 5, 1, 0]], np.float32)
    model = make_model("TopK", {"x": x}, {"k": np.array([4], np.int64)}, outputs=("v", "i"),
                       attrs={"axis": 1, "largest": largest})
    check(model, {"x": x})
