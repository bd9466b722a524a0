"""Random memory-bound basic subgraphs for property tests (hypothesis).

`basic_cases()` draws a `Case`: a BasicGraph of 1..max_ops random elementwise /
broadcast / reduce / transpose / concat / slice(split) / reshape ops over small
random shapes, the Subgraph holding all its nodes, and feeds. The reference outputs
come from powerfusion.frontend.numpy_exec.run_basic_graph.

    from tests.templates.strategies import basic_cases
    @given(basic_cases())
    def test_x(case): ...

`GraphBuilder` builds such graphs by hand (shapes inferred by running the numpy
reference on dummy data).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from powerfusion import basic as B
from powerfusion.frontend.numpy_exec import EXECUTORS, run_basic_graph

_ORIGIN = B.Origin("random", "Random", 17)


@dataclass
class Case:
    graph: B.BasicGraph
    subgraph: B.Subgraph
    feeds: dict

    def reference(self) -> dict:
        return run_basic_graph(self.graph, self.feeds)


class GraphBuilder:
    """Append basic ops one at a time; every tensor gets a concrete dummy value so the
    output shape is whatever the numpy reference produces."""

    def __init__(self, name: str = "g", seed: int = 0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.values: dict[str, np.ndarray] = {}
        self.tensors: dict[str, B.TensorInfo] = {}
        self.inputs: list[str] = []
        self.constants: dict[str, np.ndarray] = {}
        self.nodes: list[B.BasicNode] = []

    def input(self, name: str, shape, dtype="float32", low=-2.0, high=2.0, value=None) -> str:
        dt = _dtype(dtype)
        if value is None:
            if dt.kind in "iu":
                value = self.rng.integers(int(low), int(high), size=shape).astype(dt)
            elif dt.kind == "b":
                value = self.rng.random(shape) < 0.5
            else:
                value = self.rng.uniform(low, high, size=shape).astype(dt)
        self.values[name] = np.asarray(value)
        self.tensors[name] = B.TensorInfo(name, tuple(np.shape(value)), dt)
        self.inputs.append(name)
        return name

    def constant(self, name: str, value) -> str:
        value = np.asarray(value)
        self.values[name] = value
        self.constants[name] = value
        self.tensors[name] = B.TensorInfo(name, tuple(value.shape), value.dtype)
        return name

    def op(self, op, inputs, out: str | None = None, dtype=None) -> str:
        out = out or f"t{len(self.nodes)}"
        args = [self.values[i] for i in inputs]
        dt = _dtype(dtype) if dtype is not None else self.values[inputs[0]].dtype
        if isinstance(op, B.Elementwise):
            from powerfusion.scalar import scalar_fn
            res = scalar_fn(op.fn).result
            dt = np.dtype(bool) if res == "bool" else (_dtype(op.param("to")) if res == "param:to" else
                                                       (args[1].dtype if op.fn == "where" else dt))
        y = np.asarray(EXECUTORS[type(op)](op, args, dt)).astype(dt)
        self.values[out] = y
        self.tensors[out] = B.TensorInfo(out, tuple(y.shape), dt)
        self.nodes.append(B.BasicNode(f"n{len(self.nodes)}", op, tuple(inputs), (out,), _ORIGIN))
        return out

    def build(self, outputs=None) -> Case:
        used = {t for n in self.nodes for t in n.inputs}
        outputs = list(outputs) if outputs else [n.outputs[0] for n in self.nodes if n.outputs[0] not in used]
        if not outputs:
            outputs = [self.nodes[-1].outputs[0]]
        g = B.BasicGraph(self.name, [self.tensors[t] for t in self.inputs], [self.tensors[t] for t in outputs],
                         dict(self.tensors), dict(self.constants), list(self.nodes))
        produced = {n.outputs[0] for n in self.nodes}
        sub_in = tuple(dict.fromkeys(t for n in self.nodes for t in n.inputs if t not in produced))
        sub = B.Subgraph(f"sg_{self.name}", tuple(self.nodes), sub_in, tuple(outputs), 0, 0)
        return Case(g, sub, {t: self.values[t] for t in self.inputs})


def _dtype(d):
    if isinstance(d, str) and d == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(d)


_UNARY = ("relu", "neg", "abs", "exp", "tanh", "sigmoid", "identity")
_BINARY = ("add", "sub", "mul", "max", "min")
_KINDS = ("unary", "binary", "broadcast", "reduce", "transpose", "concat", "split", "reshape")


@st.composite
def basic_cases(draw, max_ops: int = 5, max_rank: int = 3, max_dim: int = 40, dtypes=("float32",)) -> Case:
    """A random subgraph mixing elementwise, broadcast, reduce, transpose, concat, split and reshape."""
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=rank, max_size=rank)))
    dtype = draw(st.sampled_from(dtypes))
    b = GraphBuilder("rand", seed=draw(st.integers(0, 2**16)))
    live = [b.input("x0", shape, dtype)]
    if draw(st.booleans()):
        live.append(b.input("x1", shape, dtype))
    for _ in range(draw(st.integers(1, max_ops))):
        x = draw(st.sampled_from(live))
        xs = b.values[x].shape
        kind = draw(st.sampled_from(_KINDS))
        if kind == "unary":
            y = b.op(B.Elementwise(draw(st.sampled_from(_UNARY))), [x])
        elif kind == "binary":
            same = [t for t in live if b.values[t].shape == xs]
            y = b.op(B.Elementwise(draw(st.sampled_from(_BINARY))), [x, draw(st.sampled_from(same))])
        elif kind == "broadcast":
            if not xs:
                continue
            keep = draw(st.lists(st.booleans(), min_size=len(xs), max_size=len(xs)))
            small = tuple(d if k else 1 for d, k in zip(xs, keep))
            src = [t for t in live if b.values[t].shape == small]
            if not src:  # make the small operand by reducing x over the dropped axes
                axes = tuple(i for i, k in enumerate(keep) if not k)
                if not axes:
                    continue
                src = [b.op(B.Reduce("max", axes, True), [x])]
            y = b.op(B.Broadcast(xs), [src[0]])
            y = b.op(B.Elementwise(draw(st.sampled_from(_BINARY))), [x, y])
        elif kind == "reduce":
            if not xs:
                continue
            axes = sorted(set(draw(st.lists(st.integers(0, len(xs) - 1), min_size=1, max_size=len(xs)))))
            y = b.op(B.Reduce(draw(st.sampled_from(("sum", "max", "min"))), tuple(axes), draw(st.booleans())), [x])
        elif kind == "transpose":
            if len(xs) < 2:
                continue
            y = b.op(B.Transpose(tuple(draw(st.permutations(range(len(xs)))))), [x])
        elif kind == "concat":
            if not xs:
                continue
            same = [t for t in live if b.values[t].shape == xs]
            y = b.op(B.Concat(draw(st.integers(0, len(xs) - 1))), [x, draw(st.sampled_from(same))])
        elif kind == "split":
            if not xs:
                continue
            axis = draw(st.integers(0, len(xs) - 1))
            if xs[axis] < 2:
                continue
            cut = draw(st.integers(1, xs[axis] - 1))
            starts = [0] * len(xs)
            stops = list(xs)
            second = draw(st.booleans())
            starts[axis], stops[axis] = (cut, xs[axis]) if second else (0, cut)
            y = b.op(B.Slice(tuple(starts), tuple(stops), (1,) * len(xs)), [x])
        else:  # reshape: merge the last two axes, or split off a factor
            if len(xs) >= 2:
                new = xs[:-2] + (xs[-2] * xs[-1],)
            elif xs and xs[0] % 2 == 0:
                new = (2, xs[0] // 2)
            else:
                continue
            y = b.op(B.Reshape(new), [x])
        live.append(y)
    if not b.nodes:
        b.op(B.Elementwise("relu"), [live[0]])
    return b.build()
