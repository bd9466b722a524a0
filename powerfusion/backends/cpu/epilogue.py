"""Activations the cpu driver applies inside a convolution (driver.h's pf_act), in place of the
memory-bound subgraph that follows it.

A Conv in a CNN is mostly followed by a subgraph that only applies ReLU, Clip (ReLU6),
hard-swish or SiLU to its output. Run apart, that subgraph reads and writes the whole tensor once more
after it has left the cache: MobileNetV2's 35 Clip subgraphs took 3.3 ms of a 12 ms run (summed
steps). Applied by the convolution to each block of outputs it has just written, it costs a
pass over data in cache. The subgraph is fused only where its one computed input is the
convolution's output, which nothing else reads, and its ops are one of the forms below; then
the convolution writes the subgraph's output and its own output is never made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from powerfusion.basic import BasicGraph, Elementwise, Subgraph


@dataclass(frozen=True)
class Activation:
    """y = clamp(x * a + b, lo, hi) (x itself where not `affine`), or sigmoid(x) where
    `sigmoid`; times x where `mul`."""
    lo: float = -math.inf
    hi: float = math.inf
    affine: bool = False
    a: float = 1.0
    b: float = 0.0
    mul: bool = False
    sigmoid: bool = False

    def c_initializer(self) -> str:
        flags = [str(int(f)) for f in (self.affine, self.mul, self.sigmoid)]
        return "{" + ", ".join([*flags, *map(_c_double, (self.a, self.b, self.lo, self.hi))]) + "}"


def _c_double(v: float) -> str:
    if math.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    return repr(float(v))


def _unary(node, x: str) -> Activation | None:
    op = node.op
    if not isinstance(op, Elementwise) or tuple(node.inputs) != (x,):
        return None
    if op.fn == "relu":
        return Activation(0.0, math.inf)
    if op.fn == "clip":
        return Activation(float(op.param("lo")), float(op.param("hi")))
    if op.fn == "hard_sigmoid":
        return Activation(0.0, 1.0, True, float(op.param("alpha")), float(op.param("beta")))
    if op.fn == "sigmoid":
        return Activation(sigmoid=True)
    return None


def conv_activation(conv_node, sub: Subgraph, graph: BasicGraph, consumers: dict, keep: frozenset) -> Activation | None:
    """The activation `sub` applies to `conv_node`'s output, where the convolution can apply it
    instead (module docstring); else None."""
    y = conv_node.outputs[0]
    if y in keep or {id(n) for n in consumers.get(y, [])} != {id(n) for n in sub.nodes if y in n.inputs}:
        return None
    if [t for t in sub.inputs if t not in graph.constants] != [y] or len(sub.outputs) != 1:
        return None
    z = sub.outputs[0]
    if graph.tensors[z].dtype != graph.tensors[y].dtype or tuple(graph.tensors[z].shape) != tuple(graph.tensors[y].shape):
        return None
    nodes = list(sub.nodes)
    if len(nodes) == 1 and nodes[0].outputs[0] == z:
        return _unary(nodes[0], y)
    if len(nodes) == 2:   # hard-swish, SiLU: x * hard_sigmoid(x), x * sigmoid(x)
        first, second = nodes
        act = _unary(first, y)
        t = first.outputs[0]
        if act is None or not (act.affine or act.sigmoid) or not isinstance(second.op, Elementwise) \
                or second.op.fn != "mul" or sorted(second.inputs) != sorted([y, t]) or second.outputs[0] != z \
                or len(consumers.get(t, [])) != 1:
            return None
        return Activation(act.lo, act.hi, act.affine, act.a, act.b, mul=True, sigmoid=act.sigmoid)
    return None
