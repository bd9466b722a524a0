"""The cost model sees what the C renderers do with long register tiles: a streamed kernel
pays another pass over its input per later loop, not register spills."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from powerfusion.frontend import import_model, partition_graph
from powerfusion.templates.merge import lower_subgraph, lowering_context
from powerfusion.perfmodel.cost import estimate
from powerfusion.targets.specs import get_target
from powerfusion.rewrite import optimise

M, N = 256, 65536


def _rmsnorm():
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rs"]),
             helper.make_node("Div", ["x", "rs"], ["y"])]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps")]
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], inits)
    graph = import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    (sub,) = partition_graph(graph).subgraphs
    return graph, sub


def test_a_warp_per_long_row_is_priced_as_streamed_not_spilled():
    graph, sub = _rmsnorm()
    t = get_target("cuda")
    ctx = lowering_context(sub, graph, t)
    choice = {n.name: next(c for c in ctx.candidates(n) if c.name in ("reduce.row_warp",) or
                           (c.name.startswith("elementwise.rows") or c.name.startswith("broadcast.rows"))
                           and getattr(c.params, "per_row", 1) == 1) for n in ctx.nodes}
    g, _ = optimise(lower_subgraph(sub, graph, choice, t, ctx=ctx))
    (kernel,) = g.kernels()
    est = estimate(g, t)
    assert "streamed" in est.limits and "register spill" not in est.limits
    x_bytes = M * N * 4
    # x is read once per loop (the reduction's, then the scaling's) and y written once
    assert 2.5 * x_bytes <= est.bytes("global") <= 3.5 * x_bytes, est.bytes("global") / x_bytes
