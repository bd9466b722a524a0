"""Random small ONNX graphs for property-based tests (hypothesis strategies).

A graph grows from one to three float32 inputs by drawn steps: elementwise (unary and
binary, with broadcasting), reduce, transpose, reshape, concat, slice, gather (constant or
run-time indices), expand. Tensor names are drawn from an adversarial pool (names that collide
after sanitising or prefixing, names of the compiler's own buffers, punctuation, long names);
shapes include zero-size and scalar tensors; input data includes infinities, NaN, -0.0 and
large values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from onnx import TensorProto as T, helper as h, numpy_helper as nh

OPSET = 17
NAME_POOL = ("x", "sg0_0", "t_sg0_0", "sg0_a", "t_sg0_a", "sg1_0", "t_sg1_0", "a.b", "a_b", "a-b", "A_B", "n0",
             "sg0_n0_in0", "const_W_1", "0lead", "plan", "x" * 120, "ünï", "a b", "y/../z")
UNARY = ("Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Exp", "Sqrt", "Reciprocal", "Identity")
BINARY = ("Add", "Sub", "Mul", "Div", "Max", "Min")
REDUCE = ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean")
SPECIAL = (np.inf, -np.inf, np.nan, -0.0, 0.0, 1e30, -1e30, 1e-30)


@dataclass
class GraphBuilder:
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)      # (name, shape, dtype)
    inits: list = field(default_factory=list)
    shapes: dict = field(default_factory=dict)      # name -> shape (float tensors)
    used: set = field(default_factory=set)

    def fresh(self, draw) -> str:
        base = draw(st.sampled_from(NAME_POOL))
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}" if k % 2 else f"t_{base}_{k}"
        self.used.add(name)
        return name

    def const(self, draw, value: np.ndarray) -> str:
        name = self.fresh(draw)
        self.inits.append(nh.from_array(np.asarray(value), name))
        return name

    def add(self, op: str, ins: list[str], out_shape, draw, **attrs) -> str:
        out = self.fresh(draw)
        self.nodes.append(h.make_node(op, ins, [out], name=self.fresh(draw), **attrs))
        self.shapes[out] = tuple(out_shape)
        return out


dims = st.integers(0, 4)
shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple) | \
    st.lists(dims, min_size=1, max_size=3).map(tuple)


def _broadcastable(draw, shape) -> tuple:
    """A shape that broadcasts with `shape` (some dims 1, some dropped from the front)."""
    keep = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - keep:]
    return tuple(d if draw(st.booleans()) else 1 for d in tail)


def _step(draw, g: GraphBuilder) -> None:
    pool = list(g.shapes)
    x = draw(st.sampled_from(pool))
    s = g.shapes[x]
    kind = draw(st.sampled_from(("unary", "binary", "binary", "reduce", "transpose", "reshape", "concat", "slice",
                                 "gather", "expand")))
    if kind == "unary":
        g.add(draw(st.sampled_from(UNARY)), [x], s, draw)
    elif kind == "binary":
        others = [t for t in pool if _bc(g.shapes[t], s)]
        if draw(st.booleans()) and others:
            y = draw(st.sampled_from(others))
        else:
            c = _broadcastable(draw, s)
            y = g.const(draw, draw(_float_arrays(c)))
            g.shapes[y] = c
        g.add(draw(st.sampled_from(BINARY)), [x, y], np.broadcast_shapes(s, g.shapes[y]), draw)
    elif kind == "reduce" and s:
        axes = sorted(set(draw(st.lists(st.integers(0, len(s) - 1), min_size=1, max_size=len(s)))))
        keep = draw(st.integers(0, 1))
        op = draw(st.sampled_from(REDUCE))
        out = tuple(1 if a in axes else d for a, d in enumerate(s) if keep or a not in axes)
        if op == "ReduceSum":
            g.add(op, [x, g.const(draw, np.array(axes, np.int64))], out, draw, keepdims=keep)
        else:
            g.add(op, [x], out, draw, axes=axes, keepdims=keep)
    elif kind == "transpose" and len(s) > 1:
        perm = draw(st.permutations(range(len(s))))
        g.add("Transpose", [x], tuple(s[p] for p in perm), draw, perm=list(perm))
    elif kind == "reshape":
        n = int(np.prod(s, dtype=np.int64))
        target = draw(st.sampled_from([(n,), (1, n), (n, 1)] + ([(2, n // 2)] if n % 2 == 0 and n else [])))
        zero = {"allowzero": 1} if 0 in target else {}   # a 0 in the shape means "copy" otherwise
        g.add("Reshape", [x, g.const(draw, np.array(target, np.int64))], target, draw, **zero)
    elif kind == "concat" and s:
        axis = draw(st.integers(0, len(s) - 1))
        same = [t for t in pool if len(g.shapes[t]) == len(s) and all(
            a == b for k, (a, b) in enumerate(zip(g.shapes[t], s)) if k != axis)]
        y = draw(st.sampled_from(same))
        out = tuple(d + g.shapes[y][axis] if k == axis else d for k, d in enumerate(s))
        g.add("Concat", [x, y], out, draw, axis=axis)
    elif kind == "slice" and s:
        axis = draw(st.integers(0, len(s) - 1))
        start = draw(st.integers(-5, 5))
        end = draw(st.integers(-5, 5))
        step = draw(st.sampled_from([1, 1, 2, -1]))
        n = len(range(*_onnx_slice(start, end, step, s[axis])))
        out = tuple(n if k == axis else d for k, d in enumerate(s))
        ins = [x] + [g.const(draw, np.array([v], np.int64)) for v in (start, end, axis, step)]
        g.add("Slice", ins, out, draw)
    elif kind == "gather" and s and s[0] > 0:
        ishape = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
        idx = draw(st.lists(st.integers(-s[0], s[0] - 1), min_size=int(np.prod(ishape)),
                            max_size=int(np.prod(ishape))))
        idx = np.array(idx, np.int64).reshape(ishape)
        if draw(st.booleans()):
            iname = g.const(draw, idx)
        else:
            iname = g.fresh(draw)
            g.inputs.append((iname, ishape, np.int64, idx))
        g.add("Gather", [x, iname], ishape + s[1:], draw, axis=0)
    elif kind == "expand" and len(s) <= 2:
        target = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(2 - len(s))) + tuple(
            d if d != 1 else draw(st.sampled_from([1, 3])) for d in s)
        g.add("Expand", [x, g.const(draw, np.array(target, np.int64))], np.broadcast_shapes(s, target), draw)


def _onnx_slice(start: int, end: int, step: int, dim: int) -> tuple[int, int, int]:
    """ONNX Slice's clamping, from the operator's specification (not Python's)."""
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    if step > 0:
        return min(max(start, 0), dim), min(max(end, 0), dim), step
    return min(max(start, 0), dim - 1), min(max(end, -1), dim - 1), step


def _bc(a, b) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def _float_arrays(shape):
    n = int(np.prod(shape, dtype=np.int64))
    finite = st.floats(-4, 4, width=32)
    value = st.one_of(finite, finite, finite, st.sampled_from(SPECIAL))
    return st.lists(value, min_size=n, max_size=n).map(lambda v: np.array(v, np.float32).reshape(shape))


@st.composite
def graphs(draw, max_steps: int = 5):
    """(onnx model, feeds)."""
    g = GraphBuilder()
    feeds = {}
    for _ in range(draw(st.integers(1, 3))):
        name, shape = g.fresh(draw), draw(shapes)
        g.shapes[name] = shape
        g.inputs.append((name, shape, np.float32, None))
    for _ in range(draw(st.integers(1, max_steps))):
        _step(draw, g)
    made = [n.output[0] for n in g.nodes]
    if not made:
        g.add("Identity", [next(iter(g.shapes))], g.shapes[next(iter(g.shapes))], draw)
        made = [g.nodes[-1].output[0]]
    outputs = list(dict.fromkeys([made[-1]] + draw(st.lists(st.sampled_from(made), max_size=2))))
    for name, shape, dtype, value in g.inputs:
        feeds[name] = value if value is not None else draw(_float_arrays(shape))
    graph = h.make_graph(
        g.nodes, "fuzz",
        [h.make_tensor_value_info(n, T.INT64 if d == np.int64 else T.FLOAT, list(s)) for n, s, d, _ in g.inputs],
        [h.make_tensor_value_info(o, T.FLOAT, list(g.shapes[o])) for o in outputs], g.inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)], ir_version=8)
    return model, feeds
