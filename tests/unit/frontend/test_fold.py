import numpy as np
import onnx
from onnx import helper

from tests.frontend.fe_helpers import check, make_model
from powerfusion.frontend import import_model, load_model
from powerfusion.frontend.fold import fold_constants

X = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)


def _shape_chain_model():
    """y = Reshape(x, concat(shape(x)[0:1], [-1])) + Expand(ConstantOfShape([1]) , shape(x)); the usual
    exporter pattern for a dynamic flatten."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("v", onnx.TensorProto.INT64, [1], [1])),
        helper.make_node("ConstantOfShape", ["one"], ["half"],
                         value=helper.make_tensor("h", onnx.TensorProto.FLOAT, [1], [0.5])),
        helper.make_node("Shape", ["flat"], ["fs"]),
        helper.make_node("Expand", ["half", "fs"], ["halves"]),
        helper.make_node("Add", ["flat", "halves"], ["y"]),
    ]
    consts = {"zero": np.array(0, np.int64), "ax0": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    return make_model(None, {"x": X}, consts, nodes=nodes)


def test_shape_subgraph_folds_away():
    folded = fold_constants(load_model(_shape_chain_model()))
    ops = [n.op_type for n in folded.graph.node]
    assert ops == ["Reshape", "Add"]
    target = {t.name: t for t in folded.graph.initializer}[folded.graph.node[0].input[1]]
    assert onnx.numpy_helper.to_array(target).tolist() == [2, -1]


def test_folded_graph_matches_onnxruntime():
    graph = check(_shape_chain_model(), {"x": X})
    assert [n.kind for n in graph.nodes] == ["move", "elementwise"]  # Reshape, Add (halves is a constant)
    assert set(graph.constants) == {n for node in graph.nodes for n in node.inputs if n in graph.constants}


def test_output_that_is_constant():
    nodes = [helper.make_node("Shape", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
    graph = check(make_model(None, {"x": X}, nodes=nodes, outputs=("y", "z")), {"x": X})
    assert graph.constants["y"].tolist() == [2, 3, 4]


def test_dead_nodes_dropped():
    nodes = [helper.make_node("Exp", ["x"], ["unused"]), helper.make_node("Relu", ["x"], ["y"])]
    graph = import_model(make_model(None, {"x": X}, nodes=nodes))
    assert [n.origin.op_type for n in graph.nodes] == ["Relu"]


def test_shape_chains_deeper_than_a_fixed_round_cap_fold_completely():
    """Each Reshape's target comes from Shape of the previous Reshape's output, whose shape is
    known only after the round before folded it: one round per link (swin_s, 24 blocks, needs
    more than 16). Every Shape folds away and the session matches numpy."""
    import powerfusion
    from onnx import TensorProto as T, helper as h
    from powerfusion.frontend.fold import fold_constants
    from powerfusion.frontend.loader import infer_shapes
    links = 24
    nodes, prev = [], "x"
    for k in range(links):
        nodes += [h.make_node("Shape", [prev], [f"s{k}"]), h.make_node("Relu", [prev], [f"r{k}"]),
                  h.make_node("Cast", [f"s{k}"], [f"f{k}"], to=T.FLOAT), h.make_node("Floor", [f"f{k}"], [f"g{k}"]),
                  h.make_node("Cast", [f"g{k}"], [f"t{k}"], to=T.INT64),   # beyond ONNX's data propagation
                  h.make_node("Reshape", [f"r{k}", f"t{k}"], [f"y{k}"])]
        prev = f"y{k}"
    g = h.make_graph(nodes, "chain", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                     [h.make_tensor_value_info(prev, T.FLOAT, None)])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    folded = fold_constants(infer_shapes(model))
    assert not [n for n in folded.graph.node if n.op_type == "Shape"]
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    (got,) = powerfusion.InferenceSession(model).run(None, {"x": x})
    np.testing.assert_array_equal(got, np.maximum(x, 0))


def test_a_constant_folds_to_what_the_reference_evaluator_gives():
    """fold.constant_value reads a Constant's `value` tensor without running onnx.reference: the
    same dtype, shape and bytes for every element type the exporters write; other forms
    (value_floats, value_int) are left to the evaluators."""
    from powerfusion.frontend.evaluate import evaluate_reference
    from powerfusion.frontend.fold import constant_value
    T = onnx.TensorProto
    values = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, np.int64), np.array([], np.int64),
              np.array([1.5, -2.0], np.float16), np.array([True, False]), np.array([[3]], np.int32),
              np.array(-0.0, np.float64), np.array([1, 255], np.uint8)]
    for k, v in enumerate(values):
        node = helper.make_node("Constant", [], [f"c{k}"], value=onnx.numpy_helper.from_array(v, f"v{k}"))
        want = evaluate_reference(node, {}, 17)[0]
        got = constant_value(node)
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), v
    bf16 = helper.make_node("Constant", [], ["b"], value=helper.make_tensor("b", T.BFLOAT16, [2], [1.0, -3.0]))
    want, got = evaluate_reference(bf16, {}, 17)[0], constant_value(bf16)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert constant_value(helper.make_node("Constant", [], ["f"], value_floats=[1.0, 2.0])) is None
    assert constant_value(helper.make_node("Constant", [], ["i"], value_int=3)) is None
