"""Drop QuantizeLinear(move(DequantizeLinear(q))) when both use the same scale and zero point.

onnxruntime's QDQ quantiser writes a Q/DQ pair after every quantised tensor, also after
Reshape / Transpose / Squeeze / Unsqueeze / Flatten whose input is already quantised with the
same parameters (BERT's q/k/v heads: MatMul -> Add -> Reshape -> Transpose, four pairs). Its
own runtime drops the redundant ones; so do we, which leaves the memory-bound subgraphs around
each integer GEMM half as many elementwise ops. The rewrite is exact: DequantizeLinear gives
x = fl((q - z) * s), a move keeps the values, and QuantizeLinear computes round(x / s) + z, where
x / s differs from the integer q - z by a few ulps of a number below 256 (far below 1/2), so it
rounds back to q - z and saturation never applies: Q(move(DQ(q))) == move(q), bit for bit.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MOVES = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity")


def drop_requantize_pairs(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every redundant QuantizeLinear replaced by the move applied to the integer
    tensor itself (in place; returned); nodes left without consumers are removed."""
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    replaced = {}
    for q in g.node:
        new = _replacement(q, producers, inits)
        if new is not None:
            replaced[id(q)] = new
    if not replaced:
        return model
    nodes = [replaced.get(id(n), n) for n in g.node]
    del g.node[:]
    g.node.extend(_live(nodes, {o.name for o in g.output}))
    return model


def _replacement(q, producers, inits):
    if q.op_type != "QuantizeLinear" or q.domain not in ("", "ai.onnx") or _attr(q, "block_size", 0):
        return None
    move = producers.get(q.input[0])
    if move is None or move.op_type not in MOVES or move.domain not in ("", "ai.onnx"):
        return None
    dq = producers.get(move.input[0])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or _attr(dq, "block_size", 0):
        return None
    if not (_same(inits, q, dq, 1) and _same(inits, q, dq, 2)):
        return None
    return helper.make_node(move.op_type, [dq.input[0]] + list(move.input[1:]), [q.output[0]],
                            name=f"{move.name or move.op_type}_on_{q.name or 'quantized'}", domain=move.domain,
                            **{a.name: helper.get_attribute_value(a) for a in move.attribute})


def _same(inits, q, dq, i: int) -> bool:
    """Input i (scale or zero point) of both nodes: the same constant scalar (dtype included)."""
    a = q.input[i] if len(q.input) > i else ""
    b = dq.input[i] if len(dq.input) > i else ""
    if not a and not b:
        return i == 2           # both without zero point: the same (uint8 0); a scale is required
    if not a or not b or a not in inits or b not in inits:
        return False
    x, y = inits[a], inits[b]
    return x.size == 1 and y.size == 1 and x.dtype == y.dtype and bool(np.array_equal(x, y))


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _live(nodes: list, outputs: set) -> list:
    """Nodes that some output depends on (the graph's nodes are topologically ordered); all of
    them where a node has subgraphs (their bodies may read any outer name)."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        return nodes
    needed, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    return keep[::-1]
