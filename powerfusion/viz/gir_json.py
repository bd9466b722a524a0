"""One GIR graph as plain JSON data for the visualiser (the `gir` objects of docs/viz.md).

Nodes are the gOperators in schedule order; edges are the dataflow of
`GIRGraph.to_networkx()` (the last writer of a buffer -> each later reader), labelled
with the reader's slice; interface buffers appear as `in:NAME` / `out:NAME` nodes so
that a subgraph's inputs and outputs are visible. Every op records the kernel it
belongs to (DEVICE syncs are the boundaries and belong to none).
"""
from __future__ import annotations

from powerfusion.gir.ir import GIRGraph, GOp, MemorySlice, Scope, Sync


def slice_json(s: MemorySlice) -> dict:
    stride = s.stride
    return {"buffer": s.buffer, "level": s.level.label, "num": s.num, "width": s.width, "stride": stride,
            "dtype": s.dtype, "vec": s.vec, "index": repr(s.index),
            "valid": None if s.valid is None else repr(s.valid), "label": slice_label(s)}


def slice_label(s: MemorySlice) -> str:
    """`level num×width/stride dtype` -- the edge label (stride omitted where not affine)."""
    stride = s.stride
    pattern = f"{s.num}\u00d7{s.width}" + (f"/{stride}" if stride is not None and s.num > 1 else "")
    return f"{s.level.label} {pattern} {s.dtype}"


def op_head(op: GOp) -> str:
    """The short label of a gOperator: describe() up to its slices."""
    return op.describe().split(" [", 1)[0]


def op_json(op: GOp, index: int, kernel: int | None, traffic: dict[str, int]) -> dict:
    scope = op.args.scope.label if isinstance(op.args, Sync) else None
    return {"index": index, "uid": op.uid, "kind": op.kind, "label": op_head(op), "describe": op.describe(),
            "origin": op.origin, "scope": scope, "guard": None if op.guard is None else repr(op.guard),
            "kernel": kernel, "inputs": [slice_json(s) for s in op.inputs],
            "outputs": [slice_json(s) for s in op.outputs], "traffic": traffic}


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


def gir_json(g: GIRGraph) -> dict:
    from powerfusion.gir.traffic import op_traffic, traffic
    kernels = kernel_of_ops(g)
    ops = [op_json(op, k, kernels[k], dict(op_traffic(op, g.parallel))) for k, op in enumerate(g.ops)]
    edges = []
    nxg = g.to_networkx()
    for a, b, data in nxg.edges(data=True):
        s = data["slice"]
        edges.append({"source": a, "target": b, "buffer": s.buffer, "label": slice_label(s)})
    written = {s.buffer for op in g.ops for s in op.outputs}
    first_read: dict[str, list] = {}
    for k, op in enumerate(g.ops):
        for s in op.inputs:
            if s.buffer in g.inputs or (s.buffer in dict(g.constants) and s.buffer not in written):
                if not any(w < k for w in _writers(g, s.buffer)):
                    first_read.setdefault(s.buffer, []).append((k, s))
    for name, reads in first_read.items():
        for k, s in reads:
            edges.append({"source": f"in:{name}", "target": k, "buffer": name, "label": slice_label(s)})
    for name in g.outputs:
        ws = _writers(g, name)
        if ws:
            s = next(s for s in g.ops[ws[-1]].outputs if s.buffer == name)
            edges.append({"source": ws[-1], "target": f"out:{name}", "buffer": name, "label": slice_label(s)})
    return {
        "name": g.name,
        "parallel": {"units": g.parallel.units, "units_per_group": g.parallel.units_per_group,
                     "lanes": g.parallel.lanes},
        "buffers": [{"name": b.name, "level": b.level.label, "size": b.size, "dtype": b.dtype} for b in g.buffers],
        "inputs": list(g.inputs), "outputs": list(g.outputs), "constants": [n for n, _ in g.constants],
        "ops": ops, "edges": edges,
        "kernels": len(g.kernels()),
        "traffic": traffic(g),
        "templates": [{"node": n, "template": t} for n, t in g.templates],
    }


def _writers(g: GIRGraph, name: str) -> list[int]:
    return [k for k, op in enumerate(g.ops) if not isinstance(op.args, Sync) and any(s.buffer == name for s in op.outputs)]
