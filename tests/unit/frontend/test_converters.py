"""Every converter against onnxruntime on small one-node graphs (fp32 tolerances: fe_helpers.TOL)."""
import numpy as np
import pytest
from onnx import helper

from tests.frontend.fe_helpers import check, make_model

R = np.random.default_rng(0)
f32 = lambda *s: R.standard_normal(s).astype(np.float32)          # noqa: E731
pos = lambda *s: (R.random(s) + 0.1).astype(np.float32)          # noqa: E731
i64 = lambda *v: np.array(v, dtype=np.int64)                      # noqa: E731
ints = lambda *s: R.integers(-9, 10, s).astype(np.int32)          # noqa: E731
bools = lambda *s: R.random(s) > 0.5                              # noqa: E731


def case(op, feeds, consts=None, attrs=None, inputs=None, outputs=("y",), opset=17, id=None, tol=None):
    return pytest.param(op, feeds, consts, attrs, inputs, outputs, opset, tol, id=id or op)


CASES = [
    # unary elementwise
    case("Sqrt", {"x": pos(2, 3)}), case("Reciprocal", {"x": pos(2, 3)}), case("Neg", {"x": f32(2, 3)}),
    case("Abs", {"x": f32(2, 3)}), case("Exp", {"x": f32(2, 3)}), case("Log", {"x": pos(2, 3)}),
    case("Erf", {"x": f32(3, 4)}), case("Tanh", {"x": f32(3, 4)}), case("Sigmoid", {"x": f32(3, 4)}),
    case("Relu", {"x": f32(3, 4)}), case("Not", {"x": bools(3, 4)}),
    case("IsNaN", {"x": np.array([1.0, np.nan, -np.inf], np.float32)}),
    case("LeakyRelu", {"x": f32(3, 4)}, attrs={"alpha": 0.1}),
    case("HardSigmoid", {"x": f32(3, 4) * 4}, attrs={"alpha": 0.3, "beta": 0.4}),
    case("HardSwish", {"x": f32(3, 4) * 4}),
    case("Gelu", {"x": f32(3, 4) * 3}, opset=20, id="Gelu-erf"),
    case("Gelu", {"x": f32(3, 4) * 3}, attrs={"approximate": "tanh"}, opset=20, id="Gelu-tanh"),
    case("PRelu", {"x": f32(2, 3, 4), "s": f32(3, 1)}), case("Elu", {"x": f32(3, 4)}, attrs={"alpha": 0.7}),
    case("Selu", {"x": f32(3, 4)}), case("Softplus", {"x": f32(3, 4) * 30}), case("Softsign", {"x": f32(3, 4)}),
    case("Mish", {"x": f32(3, 4) * 5}, opset=18),
    # binary elementwise with implicit broadcasting
    case("Add", {"a": f32(2, 3, 4), "b": f32(4)}), case("Sub", {"a": f32(2, 1, 4), "b": f32(3, 1)}),
    case("Mul", {"a": f32(2, 3), "b": f32(1, 3)}), case("Div", {"a": f32(2, 3), "b": pos(2, 3)}),
    case("Div", {"a": ints(4, 5), "b": np.array([-4, -3, 2, 3, 7], np.int32)}, id="Div-int"),
    case("Pow", {"a": pos(2, 3), "b": f32(2, 3)}),
    case("Pow", {"a": f32(2, 3)}, {"b": np.array(2.0, np.float32)}, id="Pow-square"),
    case("Pow", {"a": pos(2, 3)}, {"b": np.array(0.5, np.float32)}, id="Pow-sqrt"),
    case("Pow", {"a": f32(2, 3)}, {"b": np.array(3, np.int64)}, id="Pow-int-exponent"),
    case("Pow", {"a": f32(3, 4).astype(np.float16)}, {"b": np.array(3.0, np.float16)}, id="Pow-cube-fp16"),
    case("Equal", {"a": ints(3, 4), "b": ints(4)}), case("Less", {"a": f32(3, 4), "b": f32(4)}),
    case("Greater", {"a": f32(3, 4), "b": f32(3, 1)}), case("LessOrEqual", {"a": ints(3, 4), "b": ints(3, 4)}),
    case("GreaterOrEqual", {"a": f32(3, 4), "b": f32(4)}), case("And", {"a": bools(3, 4), "b": bools(4)}),
    case("Or", {"a": bools(3, 4), "b": bools(3, 1)}),
    case("Where", {"c": bools(3, 1), "a": f32(3, 4), "b": f32(4)}),
    case("Sum", {"a": f32(2, 3), "b": f32(3), "c": f32(2, 1)}), case("Max", {"a": f32(2, 3), "b": f32(3), "c": f32(2, 1)}),
    case("Min", {"a": f32(2, 3), "b": f32(3), "c": f32(2, 1)}), case("Sum", {"a": f32(2, 3)}, id="Sum-one"),
    case("Mean", {"a": f32(2, 3), "b": f32(3)}),
    case("Clip", {"x": f32(3, 4)}, {"lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)}),
    case("Clip", {"x": f32(3, 4)}, {"hi": np.array(0.2, np.float32)}, inputs=["x", "", "hi"], id="Clip-max-only"),
    case("Clip", {"x": f32(3, 4)}, {"lo": np.array(-0.5, np.float32)}, opset=11, id="Clip-11-min-only"),
    case("Clip", {"x": ints(3, 4)}, {"lo": np.array(-2, np.int32), "hi": np.array(3, np.int32)}, opset=13, id="Clip-int"),
    case("Cast", {"x": f32(3, 4) * 5}, attrs={"to": 6}, id="Cast-f32-int32"),
    case("Cast", {"x": f32(3, 4)}, attrs={"to": 10}, id="Cast-f32-f16"),
    case("Cast", {"x": ints(3, 4)}, attrs={"to": 9}, id="Cast-int-bool"),
    case("Identity", {"x": f32(3, 4)}),
    # reductions and composites
    case("ReduceSum", {"x": f32(2, 3, 4)}, {"axes": i64(1)}, attrs={"keepdims": 0}),
    case("ReduceSum", {"x": f32(2, 3, 4)}, opset=11, attrs={"axes": [0, 2]}, id="ReduceSum-11"),
    case("ReduceSum", {"x": f32(2, 3, 4)}, {"axes": np.zeros(0, np.int64)}, attrs={"noop_with_empty_axes": 1},
         id="ReduceSum-noop"),
    case("ReduceSum", {"x": f32(2, 3, 4)}, id="ReduceSum-all"),
    case("ReduceMean", {"x": f32(2, 3, 4)}, attrs={"axes": [-1]}, opset=13),
    case("ReduceMean", {"x": f32(2, 3, 4)}, {"axes": i64(0, 1)}, opset=18, id="ReduceMean-18"),
    case("ReduceMax", {"x": f32(2, 3, 4)}, attrs={"axes": [1], "keepdims": 0}, opset=13),
    case("ReduceMin", {"x": f32(2, 3, 4)}, {"axes": i64(2)}, opset=18),
    case("ReduceProd", {"x": pos(2, 3, 4)}, attrs={"axes": [1]}, opset=13),
    case("ReduceL2", {"x": f32(2, 3, 4)}, attrs={"axes": [2]}, opset=13),
    case("ReduceLogSumExp", {"x": f32(2, 3, 4)}, attrs={"axes": [2], "keepdims": 0}, opset=13),
    case("Softmax", {"x": f32(2, 3, 4)}), case("Softmax", {"x": f32(2, 3, 4)}, attrs={"axis": 1}, id="Softmax-axis1"),
    case("Softmax", {"x": f32(2, 3, 4)}, attrs={"axis": 1}, opset=11, id="Softmax-11-coerced"),
    case("LogSoftmax", {"x": f32(2, 3, 4)}), case("LogSoftmax", {"x": f32(2, 3, 4)}, opset=12, id="LogSoftmax-12"),
    case("LayerNormalization", {"x": f32(2, 3, 8)}, {"s": f32(8), "b": f32(8)}),
    case("LayerNormalization", {"x": f32(2, 3, 8)}, {"s": f32(3, 8)}, attrs={"axis": 1, "epsilon": 1e-3},
         outputs=("y", "mean", "inv"), id="LayerNormalization-stats"),
    case("BatchNormalization", {"x": f32(2, 3, 4, 5)}, {"s": f32(3), "b": f32(3), "m": f32(3), "v": pos(3)}),
    case("BatchNormalization", {"x": f32(2, 3, 4, 5), "s": f32(3), "b": f32(3), "m": f32(3), "v": pos(3)},
         id="BatchNormalization-runtime-params", tol=(1e-5, 1e-5)),
    case("InstanceNormalization", {"x": f32(2, 3, 4, 5)}, {"s": f32(3), "b": f32(3)}),
    case("LRN", {"x": f32(1, 6, 3, 3)}, attrs={"size": 3, "alpha": 0.01, "beta": 0.75, "bias": 1.5}),
    # moves
    case("Transpose", {"x": f32(2, 3, 4)}, attrs={"perm": [2, 0, 1]}), case("Transpose", {"x": f32(2, 3)}, id="T-default"),
    case("Reshape", {"x": f32(2, 3, 4)}, {"s": i64(0, -1)}), case("Reshape", {"x": f32(2, 3, 4)}, {"s": i64(4, 3, 2)}, id="R2"),
    case("Flatten", {"x": f32(2, 3, 4, 5)}, attrs={"axis": 2}), case("Flatten", {"x": f32(2, 3)}, attrs={"axis": 0}, id="F0"),
    case("Flatten", {"x": f32(2, 3, 4)}, attrs={"axis": -1}, id="F-neg"),
    case("Flatten", {"x": f32(2, 3, 4)}, attrs={"axis": 3}, id="F-rank"),
    case("Squeeze", {"x": f32(2, 1, 4, 1)}, {"axes": i64(-1)}),
    case("Squeeze", {"x": f32(2, 1, 4, 1)}, opset=11, id="Squeeze-11-all"),
    case("Unsqueeze", {"x": f32(2, 4)}, {"axes": i64(0, -1)}),
    case("Unsqueeze", {"x": f32(2, 4)}, attrs={"axes": [1]}, opset=11, id="Unsqueeze-11"),
    case("Concat", {"a": f32(2, 3), "b": f32(2, 5), "c": f32(2, 1)}, attrs={"axis": -1}),
    case("Split", {"x": f32(6, 4)}, {"s": i64(1, 5)}, outputs=("y", "z")),
    case("Split", {"x": f32(6, 4)}, attrs={"axis": 1, "split": [3, 1]}, outputs=("y", "z"), opset=11, id="Split-11"),
    case("Split", {"x": f32(7, 4)}, attrs={"num_outputs": 3}, outputs=("y", "z", "w"), opset=18, id="Split-18-uneven"),
    case("Split", {"x": f32(6, 4)}, outputs=("y", "z", "w"), id="Split-equal"),
    case("Slice", {"x": f32(5, 6, 7)}, {"st": i64(1, -2), "en": i64(4, 2**62), "ax": i64(0, 2)}),
    case("Slice", {"x": f32(5, 6, 7)}, {"st": i64(-1, 4), "en": i64(-2**62, 0), "ax": i64(1, 2), "sp": i64(-2, -1)},
         id="Slice-negative-steps"),
    case("Gather", {"x": f32(5, 4)}, {"i": np.array([[0, -1], [2, 3]], np.int64)}, attrs={"axis": 0}),
    case("Gather", {"x": f32(5, 4), "i": np.array([1, -1, 0], np.int64)}, attrs={"axis": 1}, id="Gather-runtime"),
    case("Gather", {"x": f32(5, 4)}, {"i": np.array(2, np.int64)}, id="Gather-scalar"),
    case("GatherElements", {"x": f32(3, 4), "i": np.array([[0, 1, -1, 2]] * 2, np.int64)}, attrs={"axis": 0}),
    case("Expand", {"x": f32(3, 1)}, {"s": i64(2, 1, 4)}),
    case("Tile", {"x": f32(2, 3)}, {"r": i64(3, 2)}),
    case("DepthToSpace", {"x": f32(1, 8, 2, 3)}, attrs={"blocksize": 2}),
    case("DepthToSpace", {"x": f32(1, 8, 2, 3)}, attrs={"blocksize": 2, "mode": "CRD"}, id="DepthToSpace-CRD"),
    case("SpaceToDepth", {"x": f32(1, 2, 4, 6)}, attrs={"blocksize": 2}),
    case("Pad", {"x": f32(2, 3)}, {"p": i64(1, 2, 0, 1), "v": np.array(1.5, np.float32)}),
    case("Pad", {"x": f32(3, 4)}, {"p": i64(2, 1, 1, 2)}, attrs={"mode": "reflect"}, id="Pad-reflect"),
    case("Pad", {"x": f32(3, 4)}, {"p": i64(1, 0, 2, 3)}, attrs={"mode": "edge"}, id="Pad-edge"),
    case("Pad", {"x": f32(3, 4)}, {"p": i64(-1, 1, 0, -2)}, id="Pad-negative"),
    case("Pad", {"x": f32(2, 3, 4)}, {"p": i64(1, 2, 3, 0), "ax": i64(0, -1)}, inputs=["x", "p", "", "ax"], opset=18,
         id="Pad-18-axes"),
    case("Pad", {"x": f32(3, 4)}, opset=11, attrs={}, id="Pad-11", consts={"p": i64(1, 1, 0, 1)}),
    case("Dropout", {"x": f32(3, 4)}, outputs=("y", "mask")),
    case("Dropout", {"x": f32(3, 4)}, {"r": np.array(0.5, np.float32), "t": np.array(False)}, id="Dropout-ratio"),
    # library ops
    case("MatMul", {"a": f32(3, 5), "b": f32(5, 4)}, tol=(1e-5, 1e-5)),
    case("MatMul", {"a": f32(2, 1, 3, 5), "b": f32(4, 5, 2)}, id="MatMul-batch-broadcast"),
    case("MatMul", {"a": f32(5), "b": f32(2, 5, 3)}, id="MatMul-1d-left"),
    case("MatMul", {"a": f32(2, 3, 5), "b": f32(5)}, id="MatMul-1d-right"),
    case("Gemm", {"a": f32(5, 3), "b": f32(4, 5)}, {"c": f32(4)}, attrs={"transA": 1, "transB": 1, "alpha": 0.5,
                                                                           "beta": 2.0}),
    case("Gemm", {"a": f32(3, 5), "b": f32(5, 4), "c": f32(3, 1)}, attrs={"beta": 0.5}, id="Gemm-runtime-C"),
    case("Gemm", {"a": f32(3, 5), "b": f32(5, 4)}, id="Gemm-noC"),
    case("Conv", {"x": f32(2, 4, 7, 6)}, {"w": f32(6, 2, 3, 2), "b": f32(6)},
         attrs={"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2], "group": 2}, tol=(1e-4, 1e-4)),
    case("Conv", {"x": f32(1, 3, 7, 8)}, {"w": f32(4, 3, 3, 3)}, attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
         id="Conv-same-upper", tol=(1e-4, 1e-4)),
    case("Conv", {"x": f32(1, 3, 7, 8)}, {"w": f32(4, 3, 2, 2)}, attrs={"auto_pad": "SAME_LOWER"},
         id="Conv-same-lower", tol=(1e-4, 1e-4)),
    case("Conv", {"x": f32(1, 8, 9, 9)}, {"w": f32(8, 1, 3, 3)}, attrs={"group": 8, "pads": [1, 1, 1, 1]},
         id="Conv-depthwise", tol=(1e-4, 1e-4)),
    case("Conv", {"x": f32(2, 3, 10)}, {"w": f32(5, 3, 3)}, attrs={"auto_pad": "VALID"}, id="Conv-1d", tol=(1e-4, 1e-4)),
    case("MaxPool", {"x": f32(1, 2, 7, 7)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    case("MaxPool", {"x": f32(1, 2, 8, 8)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
         id="MaxPool-ceil"),
    case("MaxPool", {"x": f32(1, 2, 8, 8)}, attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}, id="MaxPool-dilated"),
    case("MaxPool", {"x": f32(1, 2, 7, 7)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
         id="MaxPool-same"),
    case("AveragePool", {"x": f32(1, 2, 7, 7)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         id="AveragePool-exclude-pad"),
    case("AveragePool", {"x": f32(1, 2, 7, 7)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                                       "count_include_pad": 1}, id="AveragePool-include-pad"),
    case("AveragePool", {"x": f32(1, 2, 8, 8)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1,
                                                       "pads": [1, 1, 0, 0], "count_include_pad": 1},
         id="AveragePool-ceil-include-pad"),
    case("AveragePool", {"x": f32(1, 2, 8, 8)}, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
         id="AveragePool-ceil"),
    case("GlobalAveragePool", {"x": f32(2, 3, 4, 5)}), case("GlobalMaxPool", {"x": f32(2, 3, 4, 5)}),
]


@pytest.mark.parametrize("op,feeds,consts,attrs,inputs,outputs,opset,tol", CASES)
def test_converter_matches_onnxruntime(op, feeds, consts, attrs, inputs, outputs, opset, tol):
    model = make_model(op, feeds, consts, attrs, inputs, outputs, opset)
    rtol, atol = tol if tol else (None, None)
    graph = check(model, feeds, rtol, atol)
    assert all(n.origin.node == f"{op}_node" and n.origin.op_type == op for n in graph.nodes)


def test_elementwise_inputs_are_broadcast_explicitly():
    model = make_model("Add", {"a": f32(2, 3, 4), "b": f32(4)})
    graph = check(model, {"a": f32(2, 3, 4), "b": f32(4)})
    add = [n for n in graph.nodes if n.kind == "elementwise"]
    assert len(add) == 1 and all(graph.tensors[i].shape == (2, 3, 4) for i in add[0].inputs)
    assert [n.kind for n in graph.nodes] == ["broadcast", "elementwise"]


def test_softmax_decomposition():
    graph = check(make_model("Softmax", {"x": f32(2, 5)}), {"x": f32(2, 5)})
    fns = [(n.op.fn if n.kind in ("elementwise", "reduce") else n.kind) for n in graph.nodes]
    assert [f for f in fns if f != "broadcast"] == ["max", "sub", "exp", "sum", "reciprocal", "mul"]


def test_div_by_a_shared_divisor_is_a_reciprocal_times():
    """A row divisor ([R, 1] against [R, 64]) becomes one reciprocal per row and a multiply per
    element (fp16/bf16: test_dtypes.py), within fp32 tolerance of onnxruntime's a / b."""
    feeds = {"a": f32(8, 64), "b": pos(8, 1)}
    graph = check(make_model("Div", feeds), feeds)
    assert [n.op.fn for n in graph.nodes if n.kind == "elementwise"] == ["reciprocal", "mul"]
    recip = next(n for n in graph.nodes if n.kind == "elementwise" and n.op.fn == "reciprocal")
    assert graph.tensors[recip.outputs[0]].shape == (8, 1)


def test_div_elementwise_and_by_constant():
    """Same-shape operands stay a division; a constant divisor's reciprocal is a constant."""
    feeds = {"a": f32(4, 6), "b": pos(4, 6)}
    graph = check(make_model("Div", feeds), feeds)
    assert [n.op.fn for n in graph.nodes if n.kind == "elementwise"] == ["div"]
    feeds = {"a": f32(4, 6)}
    graph = check(make_model("Div", feeds, {"c": np.array([3.0], np.float32)}), feeds, 1e-6, 1e-7)
    assert [n.op.fn for n in graph.nodes if n.kind == "elementwise"] == ["mul"]


def test_batchnorm_folds_into_scale_and_shift():
    feeds = {"x": f32(1, 3, 2, 2)}
    model = make_model("BatchNormalization", feeds, {"s": f32(3), "b": f32(3), "m": f32(3), "v": pos(3)})
    graph = check(model, feeds)
    assert sorted(n.op.fn for n in graph.nodes if n.kind == "elementwise") == ["add", "mul"]


def test_runtime_attribute_inputs_are_unsupported():
    from powerfusion.errors import UnsupportedOpError
    from powerfusion.frontend import import_model
    nodes = [helper.make_node("Clip", ["x", "lo"], ["c"], name="clip"),
             helper.make_node("ConstantOfShape", ["shape"], ["y"], name="cos")]
    model = make_model(None, {"x": f32(3), "lo": np.array(0.0, np.float32), "shape": i64(2, 3)}, nodes=nodes,
                       outputs=("c", "y"))
    with pytest.raises(UnsupportedOpError) as e:
        import_model(model)
    assert [n[0] for n in e.value.nodes] == ["clip", "cos"]
    assert "'lo'" in str(e.value) and "run time" in str(e.value)


def test_reshape_with_bad_shape_is_node_error():
    from powerfusion.errors import NodeError
    from powerfusion.frontend.builder import GraphBuilder, NodeCtx
    from powerfusion.basic import TensorInfo
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="r")
    infos = {"x": TensorInfo("x", (2, 3), np.dtype(np.float32))}
    cx = NodeCtx(node, 17, GraphBuilder(set()), {"s": i64(4, 2)}, infos, 0)
    from powerfusion.frontend.ops_shape import convert_reshape
    with pytest.raises(NodeError, match=r"node 'r' \(Reshape, opset 17.*\(2, 3\)"):
        convert_reshape(cx)


REQUIRED = """Add Sub Mul Div Pow Sqrt Reciprocal Neg Abs Exp Log Erf Tanh Sigmoid Relu LeakyRelu Clip HardSigmoid
HardSwish Gelu Softmax LogSoftmax LayerNormalization BatchNormalization InstanceNormalization ReduceMean ReduceSum
ReduceMax ReduceMin Transpose Reshape Flatten Squeeze Unsqueeze Concat Split Slice Gather Expand Where Cast Equal
Less Greater Not And Sum Max Min Identity Dropout Constant ConstantOfShape Shape Pad MatMul Gemm Conv MaxPool
AveragePool GlobalAveragePool""".split()


def test_every_required_op_is_converted_and_tested():
    from powerfusion.frontend.converters import CONVERTERS
    assert set(REQUIRED) <= set(CONVERTERS)
    tested = {p.values[0] for p in CASES} | {"Constant", "ConstantOfShape", "Shape"}  # those: test_fold.py
    assert set(REQUIRED) <= tested


def test_long_layernorm_with_a_large_offset():
    """Rows of 32768 elements whose mean is far larger than their spread: the two-pass
    statistics stay within `compare`'s fp32 tolerance of onnxruntime (1e-3: summing 32768
    values near 1000 in float32 leaves the mean a few ulps of 3e7 off, and the normalised
    output up to 3e-4 off; the two differ in summation order)."""
    R = np.random.default_rng(7)
    n = 32768
    feeds = {"x": (R.standard_normal((2, n)) + 1000.0).astype(np.float32)}
    consts = {"s": f32(n), "b": f32(n)}
    check(make_model("LayerNormalization", feeds, consts, {"axis": -1}), feeds, 1e-3, 1e-3)
