"""The anchor polish: coordinate descent over MatMul / Reduce choices around the best plan
finds pairings enumerate_plans does not offer (decode attention's q.K^T with its probs.V)."""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from powerfusion.frontend import import_model, partition_graph
from powerfusion.pipeline import search
from powerfusion.pipeline.search import choose_plan

H, T, D = 12, 16384, 64


def _decode_attention():
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "decode", [helper.make_tensor_value_info("q", f, [1, H, 1, D]),
                                            helper.make_tensor_value_info("k", f, [1, H, T, D]),
                                            helper.make_tensor_value_info("v", f, [1, H, T, D])],
                          [helper.make_tensor_value_info("y", f, [1, H, 1, D])],
                          [numpy_helper.from_array(np.array(1 / math.sqrt(D), np.float32), "scale")])
    graph = import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    (sub,) = partition_graph(graph).subgraphs
    return graph, sub


def test_polish_finds_a_better_pairing_than_the_enumerated_plans(monkeypatch):
    graph, sub = _decode_attention()
    polished = choose_plan(sub, graph, "cuda", cache=False, budget_s=None)
    monkeypatch.setattr(search, "POLISH_REWRITES", 0)
    plain = choose_plan(sub, graph, "cuda", cache=False, budget_s=None)
    assert polished.considered > plain.considered
    assert polished.predicted_s < plain.predicted_s
    assert polished.predicted_s == min(r.predicted_s for r in polished.top)
