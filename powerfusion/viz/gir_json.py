"""One GIR graph as plain JSON data for the visualiser (the `gir` objects of docs/viz.md).

Nodes are the gOperators in schedule order; edges are dataflow, labelled with the
reader's slice: like `GIRGraph.to_networkx()` (writer of a buffer -> later reader), except
that consecutive writers of one buffer with no read between them (a concat's moves, each
filling its part) all feed the next reader, not only the last of them; interface buffers appear as `in:NAME` / `out:NAME` nodes so
that a subgraph's inputs and outputs are visible. Every op records the kernel it
belongs to (DEVICE syncs are the boundaries and belong to none).
"""
from __future__ import annotations

from powerfusion.gir.ir import GIRGraph, GOp, MemorySlice, Scope, Sync


class Memo:
    """JSON of gOperators and slices by object identity: the stages of one trace share most of
    their (immutable) gOperators, so each is described once. Holds the objects, so ids stay valid."""

    def __init__(self):
        self.ops: dict[int, tuple[GOp, dict]] = {}
        self.slices: dict[int, tuple[MemorySlice, dict]] = {}

    def slice(self, s: MemorySlice) -> dict:
        hit = self.slices.get(id(s))
        if hit is None or hit[0] is not s:
            hit = self.slices[id(s)] = (s, slice_json(s))
        return hit[1]

    def op(self, op: GOp, parallel) -> dict:
        hit = self.ops.get(id(op))
        if hit is None or hit[0] is not op:
            hit = self.ops[id(op)] = (op, op_content(op, parallel, self))
        return hit[1]


def slice_json(s: MemorySlice) -> dict:
    stride = s.stride
    return {"buffer": s.buffer, "level": s.level.label, "num": s.num, "width": s.width, "stride": stride,
            "dtype": s.dtype, "vec": s.vec, "index": repr(s.index),
            "valid": None if s.valid is None else repr(s.valid), "label": slice_label(s, stride)}


def slice_label(s: MemorySlice, stride: int | None = None) -> str:
    """`level num×width/stride dtype` -- the edge label (stride shown where num > 1 and affine)."""
    stride = s.stride if stride is None and s.num > 1 else stride
    pattern = f"{s.num}\u00d7{s.width}" + (f"/{stride}" if stride is not None and s.num > 1 else "")
    return f"{s.level.label} {pattern} {s.dtype}"


def op_head(op: GOp, described: str | None = None) -> str:
    """The short label of a gOperator: describe() up to its slices."""
    return (described or op.describe()).split(" [", 1)[0]


def op_content(op: GOp, parallel, memo: Memo) -> dict:
    """Everything about a gOperator that does not depend on where it sits in a schedule."""
    from powerfusion.gir.traffic import op_traffic
    described = op.describe()
    return {"uid": op.uid, "kind": op.kind, "label": op_head(op, described), "describe": described,
            "origin": op.origin, "scope": op.args.scope.label if isinstance(op.args, Sync) else None,
            "guard": None if op.guard is None else repr(op.guard),
            "inputs": [memo.slice(s) for s in op.inputs], "outputs": [memo.slice(s) for s in op.outputs],
            "traffic": dict(op_traffic(op, parallel))}


def kernel_of_ops(g: GIRGraph) -> list[int | None]:
    """Per op index: the kernel it runs in (the same split as GIRGraph.kernels())."""
    out, k, started = [], 0, False
    for op in g.ops:
        if isinstance(op.args, Sync) and op.args.scope == Scope.DEVICE:
            out.append(None)
            if started:
                k, started = k + 1, False
        else:
            out.append(k)
            started = True
    return out


def gir_json(g: GIRGraph, memo: Memo | None = None) -> dict:
    from powerfusion.gir.traffic import traffic
    memo = memo or Memo()
    kernels = kernel_of_ops(g)
    ops = [{"index": k, **memo.op(op, g.parallel), "kernel": kernels[k]} for k, op in enumerate(g.ops)]
    constants = [n for n, _ in g.constants]
    return {
        "name": g.name,
        "parallel": {"units": g.parallel.units, "units_per_group": g.parallel.units_per_group,
                     "lanes": g.parallel.lanes},
        "buffers": [{"name": b.name, "level": b.level.label, "size": b.size, "dtype": b.dtype} for b in g.buffers],
        "inputs": list(g.inputs), "outputs": list(g.outputs), "constants": constants,
        "ops": ops, "edges": dataflow_edges(ops, g.inputs, g.outputs, constants),
        "kernels": len(g.kernels()),
        "traffic": traffic(g),
    }


def dataflow_edges(ops: list[dict], inputs, outputs, constants) -> list[dict]:
    """Edges of a GIR JSON graph from its ops alone (viewer.js `dataflowEdges` is the same
    algorithm, so pages need not store edges)."""
    outside = set(inputs) | set(constants)
    edges = []
    pending: dict[str, list[int]] = {}   # buffer -> its writers since it was last read after a write
    read_since: dict[str, bool] = {}
    last_data: dict[str, list[int]] = {}  # the same, ignoring syncs (what the outputs come from)

    def edge(a, b, s):
        edges.append({"source": a, "target": b, "buffer": s["buffer"], "label": s["label"]})
    for k, op in enumerate(ops):
        for s in op["inputs"]:
            b = s["buffer"]
            if b in pending:
                for w in pending[b]:
                    edge(w, k, s)
            elif b in outside:
                edge(f"in:{b}", k, s)
            read_since[b] = True
        for s in op["outputs"]:
            b = s["buffer"]
            if read_since.get(b, True):
                pending[b] = []
            if k not in pending[b]:
                pending[b].append(k)
            read_since[b] = False
            if op["kind"] != "sync":
                last_data[b] = list(pending[b])
    for name in outputs:
        for w in last_data.get(name, ()):
            s = next(s for s in ops[w]["outputs"] if s["buffer"] == name)
            edge(w, f"out:{name}", s)
    return edges
