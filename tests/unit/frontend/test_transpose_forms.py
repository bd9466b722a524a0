"""Transposes that only move extent-1 axes are reshapes (no data moves); a bad perm is an
error naming the node."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from powerfusion.errors import PowerFusionError
from powerfusion import basic as B
from powerfusion.frontend import import_model


def _model(shape, perm):
    out = [shape[p] for p in perm] if sorted(perm) == list(range(len(shape))) else shape
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=perm, name="tr")], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("shape,perm,moves", [((4, 12, 1, 64), (0, 2, 1, 3), False),
                                              ((1, 5, 7), (1, 0, 2), False),
                                              ((4, 12, 2, 64), (0, 2, 1, 3), True),
                                              ((1, 5, 7), (0, 2, 1), True)])
def test_unit_axis_moves_become_reshapes(shape, perm, moves):
    graph = import_model(_model(shape, perm))
    kinds = {type(n.op) for n in graph.nodes}
    assert (B.Transpose in kinds) == moves
    assert graph.outputs[0].shape == tuple(shape[p] for p in perm)


def test_bad_perm_names_the_node():
    with pytest.raises(PowerFusionError) as e:   # onnx shape inference or the converter
        import_model(_model((2, 3), (0, 0)))
    assert "tr" in str(e.value) and "Transpose" in str(e.value)


def _attention_scores(scale_both: bool):
    """q [2, 5, 8] . (k [2, 5, 8] -> Transpose(0, 2, 1) -> Reshape [1, 2, 8, 5] -> * s) as the
    exporters write attention's k^T with half the scale on each side."""
    from onnx import numpy_helper as nh
    inits = [nh.from_array(np.array(0.35, np.float32), "s"), nh.from_array(np.array([1, 2, 8, 5], np.int64), "kshape"),
             nh.from_array(np.array([1, 2, 5, 8], np.int64), "qshape")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["kt", "kshape"], ["kt4"]),
             helper.make_node("Mul", ["kt4", "s"], ["kts"]),
             helper.make_node("Reshape", ["q", "qshape"], ["q4"]),
             helper.make_node("Mul", ["q4", "s"], ["qs"]) if scale_both else helper.make_node("Identity", ["q4"], ["qs"]),
             helper.make_node("MatMul", ["qs", "kts"], ["y"])]
    g = helper.make_graph(nodes, "scores", [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 5, 8]),
                                            helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 5, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 5, 5])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("scale_both", [True, False])
def test_scaled_k_transpose_is_read_through_the_matmul_flag(scale_both):
    from powerfusion.frontend import run_basic_graph
    graph = import_model(_attention_scores(scale_both))
    assert B.Transpose not in {type(n.op) for n in graph.nodes}
    (mm,) = [n for n in graph.nodes if isinstance(n.op, B.MatMul)]
    assert mm.op.trans_b
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    want = ((q * (0.35 if scale_both else 1.0)) @ (k.transpose(0, 2, 1) * np.float32(0.35))).reshape(1, 2, 5, 5)
    got = run_basic_graph(graph, {"q": q, "k": k})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)   # float32, same products, one reordering


@pytest.mark.parametrize("index", [0, 2, -1])
def test_constant_gather_of_a_transpose_is_a_slice_before_it(index):
    """ViT's unbind of a packed QKV: Transpose(3, 1, 2, 0, 4) -> squeeze -> Gather(0, i) reads the
    i-th third of each row: a Slice of the transpose's input, no Gather and no data-moving
    Transpose left."""
    from onnx import numpy_helper as nh
    from powerfusion.frontend import run_basic_graph
    inits = [nh.from_array(np.array([3, 5, 1, 8], np.int64), "sq"), nh.from_array(np.array(index, np.int64), "i")]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[3, 1, 2, 0, 4]),
             helper.make_node("Reshape", ["t", "sq"], ["s"]),
             helper.make_node("Gather", ["s", "i"], ["y"], axis=0)]
    g = helper.make_graph(nodes, "unbind", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 1, 3, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 1, 8])], inits)
    graph = import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    kinds = {type(n.op) for n in graph.nodes}
    assert B.Gather not in kinds and B.Transpose not in kinds and B.Slice in kinds
    x = np.random.default_rng(0).standard_normal((1, 5, 1, 3, 8)).astype(np.float32)
    want = x.transpose(3, 1, 2, 0, 4).reshape(3, 5, 1, 8)[index]
    np.testing.assert_array_equal(run_basic_graph(graph, {"x": x})["y"], want)   # a pure move: exact
