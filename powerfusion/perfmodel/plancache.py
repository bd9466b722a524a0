"""Plan decisions cached by the structural hash of a subgraph, in memory and on disk.

The key hashes what decides a plan -- op kinds and arguments, shapes, dtypes, which
tensors are inputs, constants (integer constants by value: gather indices), outputs --
with tensors numbered by first use, so the twelve identical layers of a BERT share one
key although every tensor name differs. It also hashes the target and the source of the
modules that produce plans (templates, lowering, rewrites, this model), so a code change
invalidates old decisions.

A hit holds the plan (template label per op), its merged graph and its optimised graph
as built for some *other* subgraph. We re-lower the labels under this subgraph's names
(cheap), pair the two merged graphs' buffers by position, check that renaming makes the
old merged graph equal to the new one, and rename the optimised graph the same way;
buffers that rewrites created (`x_pre`, `x_block`) follow their stem's new name.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from powerfusion.frontend.basic import BasicGraph, Subgraph
from powerfusion.gir.expr import BinOp, Const, Expr, Load, Select, Var, binop, select
from powerfusion.gir.ir import GIRGraph, GOp, MemorySlice
from powerfusion.perfmodel.specs import TargetSpec

FORMAT = 1
_MEMO: dict[str, object] = {}   # key -> PlanChoice (with its graphs as built for the first subgraph seen)
_CODE_DIRS = ("gir", "templates", "rewrite", "perfmodel")


@lru_cache(maxsize=1)
def code_version() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in _CODE_DIRS:
        for p in sorted((root / d).glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def structural_key(sub: Subgraph, graph: BasicGraph, t: TargetSpec) -> str:
    ids: dict[str, int] = {}

    def tid(name: str) -> int:
        return ids.setdefault(name, len(ids))

    h = hashlib.sha256(f"{FORMAT}|{code_version()}|{t.name}|{t.backend}|{t.lanes}".encode())
    for n in sub.nodes:
        ins = [tid(x) for x in n.inputs]
        outs = [tid(x) for x in n.outputs]
        h.update(f"{type(n.op).__name__}|{n.op!r}|{ins}|{outs};".encode())
    for name, k in ids.items():
        info = graph.tensors[name]
        h.update(f"{k}:{tuple(info.shape)}:{np.dtype(info.dtype).name}".encode())
        if name in graph.constants:
            v = np.asarray(graph.constants[name])
            h.update(b"c")
            if v.dtype.kind in "iub":
                h.update(np.ascontiguousarray(v).tobytes())
    h.update(f"in{[ids[x] for x in sub.inputs]}out{[ids[x] for x in sub.outputs]}".encode())
    return h.hexdigest()[:32]


def clear_memo() -> None:
    _MEMO.clear()


def _path(key: str) -> Path:
    from powerfusion import options
    return Path(options.current().cache_dir) / "plans" / f"{key}.pkl"


def store(key: str, sub: Subgraph, graph: BasicGraph, t: TargetSpec, choice) -> None:
    _MEMO[key] = choice
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        slim = replace(choice, graph=_no_constants(choice.graph), merged=_no_constants(choice.merged), trace=())
        tmp = path.with_suffix(f".tmp{id(choice)}")
        tmp.write_bytes(pickle.dumps((FORMAT, slim), protocol=pickle.HIGHEST_PROTOCOL))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache directory costs a warm start, nothing else


def lookup(key: str, sub: Subgraph, graph: BasicGraph, t: TargetSpec, want_measured: bool = False):
    cached, source = _MEMO.get(key), "memo"
    if cached is None:
        path = _path(key)
        if not path.exists():
            return None
        try:
            fmt, cached = pickle.loads(path.read_bytes())
        except Exception:
            return None
        if fmt != FORMAT:
            return None
        _MEMO[key] = cached
        source = "disk"
    if want_measured and cached.measured_s is None:
        return None
    rebound = rebind(cached, sub, graph, t)
    if rebound is None:
        return None
    return replace(rebound, source=source)


def rebind(choice, sub: Subgraph, graph: BasicGraph, t: TargetSpec):
    """The cached choice under this subgraph's names, or None when it does not carry over."""
    from powerfusion.gir.lower import LowerError, _Plan, lower_subgraph
    plan = _Plan(sub, graph, t)
    if len(plan.nodes) != len(choice.labels):
        return None
    picked = {}
    try:
        for node, label in zip(plan.nodes, choice.labels):
            match = [c for c in plan.candidates(node) if c.label == label]
            if not match:
                return None
            picked[node.name] = match[0]
        merged = lower_subgraph(sub, graph, picked, t)
    except LowerError:
        return None
    old = choice.merged
    if merged.name == old.name and merged.buffers == old.buffers and merged.ops == old.ops:
        graph_opt = replace(choice.graph, constants=merged.constants)
        return replace(choice, graph=graph_opt, merged=merged)
    if len(old.buffers) != len(merged.buffers):
        return None
    mapping = {}
    for a, b in zip(old.buffers, merged.buffers):
        if (a.level, a.size, a.dtype) != (b.level, b.size, b.dtype):
            return None
        mapping[a.name] = b.name
    nodes = {a: b for (a, _), (b, _) in zip(old.templates, merged.templates)}
    if rename(old, mapping, nodes).ops != merged.ops:
        return None
    full = _extend(mapping, [b.name for b in choice.graph.buffers])
    if full is None:
        return None
    opt = replace(rename(choice.graph, full, nodes), name=merged.name, templates=merged.templates,
                  constants=merged.constants)
    return replace(choice, graph=opt, merged=merged, trace=())


def _extend(mapping: dict[str, str], names) -> dict[str, str] | None:
    """Names created by rewrites are `<old name>_<suffix>`: map them by their longest known stem."""
    out = dict(mapping)
    stems = sorted(mapping, key=len, reverse=True)
    for n in names:
        if n in out:
            continue
        stem = next((s for s in stems if n.startswith(s + "_")), None)
        if stem is None:
            return None
        out[n] = mapping[stem] + n[len(stem):]
    if len(set(out.values())) != len(out):
        return None
    return out


def rename(g: GIRGraph, m: dict[str, str], nodes: dict[str, str] | None = None) -> GIRGraph:
    """The graph with buffers renamed by `m` and gOperator origins (basic node names) by `nodes`."""
    nodes = nodes or {}

    def origin(o: str) -> str:
        head, _, tail = o.rpartition(":")
        return f"{head}:{nodes.get(tail, tail)}" if head else nodes.get(o, o)

    def sl(s: MemorySlice) -> MemorySlice:
        return replace(s, buffer=m.get(s.buffer, s.buffer), index=_rx(s.index, m),
                       valid=None if s.valid is None else _rx(s.valid, m))

    ops = tuple(replace(op, inputs=tuple(sl(s) for s in op.inputs), outputs=tuple(sl(s) for s in op.outputs),
                        guard=None if op.guard is None else _rx(op.guard, m), origin=origin(op.origin))
                for op in g.ops)
    return replace(g, ops=ops, buffers=tuple(replace(b, name=m.get(b.name, b.name)) for b in g.buffers),
                   inputs=tuple(m.get(x, x) for x in g.inputs), outputs=tuple(m.get(x, x) for x in g.outputs),
                   constants=tuple((m.get(n, n), v) for n, v in g.constants))


def _rx(e: Expr, m: dict[str, str]) -> Expr:
    if isinstance(e, (Var, Const)):
        return e
    if isinstance(e, BinOp):
        return BinOp(e.op, _rx(e.a, m), _rx(e.b, m))
    if isinstance(e, Select):
        return Select(_rx(e.cond, m), _rx(e.a, m), _rx(e.b, m))
    if isinstance(e, Load):
        return Load(m.get(e.buffer, e.buffer), _rx(e.index, m))
    raise TypeError(e)


def _no_constants(g: GIRGraph) -> GIRGraph:
    return replace(g, constants=())
