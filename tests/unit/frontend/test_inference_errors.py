"""Every shape-inference error names the node -- its name (or, unnamed, `<op_type>_<index>`, as
the converters call it), op type and opset -- and the shapes involved. Malformed models reach
each path: onnx's strict inference (declared shapes or types that disagree, bad attributes,
bad input types), the converters' invalid-input probe and the no-static-shape fallback."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

import powerfusion
from powerfusion.errors import PowerFusionError


def _vi(n, s, t=T.FLOAT):
    return h.make_tensor_value_info(n, t, s)


def _c(name, v):
    return nh.from_array(np.array(v, np.int64), name)


def _model(node, ins, outs, inits=(), value_info=(), then=None):
    pre = h.make_node("Identity", [ins[0].name], ["first"])   # the bad node is the graph's second: index 1
    node.input[0] = "first"
    if then is not None:   # the bad node's output is an intermediate tensor
        outs = [_vi(then.output[0], [2, 3])]
    g = h.make_graph([pre, node] + ([then] if then is not None else []), "g", ins, outs, list(inits),
                     value_info=list(value_info))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


# name -> (model, text the message must also hold: the offending shape or type)
CASES = {
    "declared_output_shape": (_model(h.make_node("Relu", ["x"], ["y"]), [_vi("x", [2, 3])], [_vi("y", [3, 3])]),
                              "'y' float32 [3, 3]"),
    "declared_output_rank": (_model(h.make_node("Relu", ["x"], ["y"]), [_vi("x", [2, 3])], [_vi("y", [2, 3, 1])]),
                             "'y' float32 [2, 3, 1]"),
    "declared_output_type": (_model(h.make_node("Relu", ["x"], ["y"]), [_vi("x", [2, 3])], [_vi("y", [2, 3], T.INT64)]),
                             "'y' int64 [2, 3]"),
    "declared_value_info": (_model(h.make_node("Relu", ["x"], ["t"]), [_vi("x", [2, 3])], [],
                                   value_info=[_vi("t", [4, 3])], then=h.make_node("Neg", ["t"], ["y"])),
                            "'t' float32 [4, 3]"),
    "operand_types": (_model(h.make_node("Add", ["x", "i"], ["y"]), [_vi("x", [2, 3]), _vi("i", [2, 3], T.INT64)],
                             [_vi("y", [2, 3])]), "'i' int64 [2, 3]"),
    "matmul_declared": (_model(h.make_node("MatMul", ["x", "w"], ["y"]), [_vi("x", [2, 3]), _vi("w", [3, 4])],
                               [_vi("y", [2, 5])]), "'w' float32 [3, 4]"),
    "gather_float_indices": (_model(h.make_node("Gather", ["x", "i"], ["y"]), [_vi("x", [2, 3]), _vi("i", [2])],
                                    [_vi("y", [2, 3])]), "'i' float32 [2]"),
    "cast_to_unknown_type": (_model(h.make_node("Cast", ["x"], ["y"], to=99), [_vi("x", [2, 3])], [_vi("y", [2, 3])]),
                             "'first' float32 [2, 3]"),
    "transpose_perm_rank": (_model(h.make_node("Transpose", ["x"], ["y"], perm=[0, 1, 2]), [_vi("x", [2, 3])],
                                   [_vi("y", [2, 3])]), "'first' float32 [2, 3]"),
    "where_float_condition": (_model(h.make_node("Where", ["x", "x", "x"], ["y"]), [_vi("x", [2, 3])],
                                     [_vi("y", [2, 3])]), "float32 [2, 3]"),
    "split_declared": (_model(h.make_node("Split", ["x"], ["y", "z"], axis=0), [_vi("x", [4, 3])],
                              [_vi("y", [2, 3]), _vi("z", [3, 3])]), "'z' float32 [3, 3]"),
    "reduce_declared": (_model(h.make_node("ReduceSum", ["x", "a"], ["y"], keepdims=0), [_vi("x", [4, 3])],
                               [_vi("y", [4])], [_c("a", [0])]), "'y' float32 [4]"),
    "conv_declared": (_model(h.make_node("Conv", ["x", "w"], ["y"]), [_vi("x", [1, 2, 5, 5]), _vi("w", [4, 2, 3, 3])],
                             [_vi("y", [1, 4, 5, 5])]), "'w' float32 [4, 2, 3, 3]"),
    # the converters' paths: the ONNX reference's complaint, and no static shape
    "reshape_two_minus_one": (_model(h.make_node("Reshape", ["x", "s"], ["y"]), [_vi("x", [2, 3, 4])],
                                     [_vi("y", ["a", "b"])], [_c("s", [-1, -1])]), "(2, 3, 4)"),
    "slice_step_zero": (_model(h.make_node("Slice", ["x", "a", "b", "c", "d"], ["y"]), [_vi("x", [4, 4])],
                               [_vi("y", ["a", "b"])], [_c("a", [0]), _c("b", [2]), _c("c", [0]), _c("d", [0])]),
                        "(4, 4)"),
    "flatten_axis": (_model(h.make_node("Flatten", ["x"], ["y"], axis=5), [_vi("x", [2, 3])], [_vi("y", ["a", "b"])]),
                     "axis=5"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("named", [False, True])
def test_shape_inference_errors_name_the_node(case, named):
    model, shape = CASES[case]
    node = model.graph.node[1]
    if named:
        node.name = "the_node"
    want = "'the_node'" if named else f"'{node.op_type}_1'"
    with warnings.catch_warnings(), pytest.raises(PowerFusionError) as info:
        warnings.simplefilter("ignore")
        powerfusion.InferenceSession(model.SerializeToString())
    text = str(info.value)
    assert f"node {want} ({node.op_type}, opset 17" in text, text
    assert shape in text, text


def test_failed_inference_names_the_failing_node_not_everything_downstream():
    """Strict inference stops at one node; the fallback check must not then list every later
    node (a Constant feeding ConstantOfShape reads as 'computed at run time' in the weightless
    skeleton, and everything after the failure has no shape): the failing node is reported."""
    nodes = [h.make_node("Relu", ["x"], ["t"]),
             h.make_node("Constant", [], ["c"], value=nh.from_array(np.array([2, 3], np.int64))),
             h.make_node("ConstantOfShape", ["c"], ["z"], value=nh.from_array(np.array([1.0], np.float32))),
             h.make_node("Add", ["t", "z"], ["y"])]
    g = h.make_graph(nodes, "g", [_vi("x", [2, 3])], [_vi("y", [2, 3])], value_info=[_vi("t", [2, 3], T.INT64)])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    with warnings.catch_warnings(), pytest.raises(PowerFusionError) as info:
        warnings.simplefilter("ignore")
        powerfusion.InferenceSession(model.SerializeToString(), target="cpu-reference")
    text = str(info.value)
    assert "must be a constant" not in text and "ConstantOfShape" not in text, text
    assert "'t' int64" in text or "Relu" in text, text
