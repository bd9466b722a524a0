"""Plan decisions cached by the structural hash of a subgraph, in memory and on disk.

The key hashes what decides a plan -- op kinds and arguments, shapes, dtypes, which
tensors are inputs, constants (integer constants by value: gather indices), outputs --
with tensors numbered by first use, so the twelve identical layers of a BERT share one
key although every tensor name differs. It also hashes the target and the source of the
modules that produce plans (templates, lowering, rewrites, this model), so a code change
invalidates old decisions.

A hit holds the plan (template label per op), its merged graph and its optimised graph
as built for some *other* subgraph, with the names that subgraph gave its tensors and
template-local buffers in structural order. Pairing them with this subgraph's names
gives a renaming; template-local buffers (`<subgraph>_<node>_<suffix>`) and buffers the
rewrites created (`x_pre`, `x_block`) follow their prefix. Renaming costs far less than
lowering again (which builds every template candidate); tests check that it yields
exactly what lowering and rewriting this subgraph with the same choice would.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from powerfusion.basic import BasicGraph, Subgraph
from powerfusion.gir.expr import BinOp, Const, Expr, Load, Select, Var, loads, shared_node
from powerfusion.gir.ir import GIRGraph, MemorySlice
from powerfusion.targets.specs import TargetSpec

FORMAT = 4      # 3: JSON entries carrying their key and a SHA-256 of their content; 4: shared subexpressions
_MEMO: dict[str, tuple] = {}   # key -> (PlanChoice as built for the first subgraph seen, its _Names)
MAX_ENTRY_BYTES = 64 << 20   # a larger file is not one of ours
_CODE_DIRS = ("gir", "templates", "rewrite", "perfmodel", "pipeline", "targets")


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
                h.update(np.asarray(v, order="C").tobytes())
    h.update(f"in{[ids[x] for x in sub.inputs]}out{[ids[x] for x in sub.outputs]}".encode())
    return h.hexdigest()


def clear_memo() -> None:
    _MEMO.clear()


def _path(key: str) -> Path:
    from powerfusion import options
    return Path(options.current().cache_dir) / "plans" / f"{key}.json"


@dataclass(frozen=True)
class _Names:
    """How a subgraph names things, in structural order: GLOBAL buffer per tensor, the
    local-buffer stem per basic node, the node names (gOperator origins)."""
    tensors: tuple[str, ...]
    stems: tuple[str, ...]
    nodes: tuple[str, ...]
    graph: str


def _names(sub: Subgraph, graph: BasicGraph, t: TargetSpec) -> _Names:
    from powerfusion.templates.merge import MergePlan
    from powerfusion.templates.common import sanitize
    plan = MergePlan(sub, graph, t)
    order = list(dict.fromkeys(x for n in sub.nodes for x in n.inputs + n.outputs))
    prefix = sanitize(sub.name)
    return _Names(tuple(plan.names[x] for x in order), tuple(sanitize(f"{prefix}_{n.name}") for n in sub.nodes),
                  tuple(n.name for n in sub.nodes), prefix)


def names_of(sub: Subgraph, graph: BasicGraph, t: TargetSpec) -> _Names:
    return _names(sub, graph, t)


def store(key: str, sub: Subgraph, graph: BasicGraph, t: TargetSpec, choice) -> None:
    entry = (choice, _names(sub, graph, t))
    _MEMO[key] = entry
    text = stored_text(key, choice, entry[1])
    if text is not None:   # None: something outside the plan vocabulary: kept in memory only
        _write(key, text)


def stored_text(key: str, choice, names: _Names) -> str | None:
    """The entry as stored on disk (no constant values, no rewrite trace), or None when the
    choice holds something the plan codec does not write."""
    try:
        return entry_text(key, replace(choice, graph=_no_constants(choice.graph),
                                       merged=_no_constants(choice.merged), trace=()), names)
    except TypeError:
        return None


def has(key: str) -> bool:
    """Whether a decision for `key` is held in memory or on disk (not read or checked here)."""
    if key in _MEMO:
        return True
    try:
        return _path(key).is_file()
    except OSError:
        return False


def adopt(key: str, text: str) -> bool:
    """Take an entry made elsewhere (a search worker's stored_text) into memory and onto disk;
    False when it does not read back as an entry for `key`."""
    entry = read_entry(text, key)
    if entry is None:
        return False
    _MEMO[key] = entry
    _write(key, text)
    return True


def _write(key: str, text: str) -> None:
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{id(text)}")
        try:
            tmp.write_text(text)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        from powerfusion.errors import cache_unusable
        cache_unusable("plan", path.parent, e)


def entry_text(key: str, choice, names: _Names) -> str:
    """One entry: its key, the plan as data (plan_codec), and a SHA-256 of that data."""
    from powerfusion.pipeline.plan_codec import encode
    payload = {"choice": encode(choice), "names": [list(names.tensors), list(names.stems),
                                                    list(names.nodes), names.graph]}
    body = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return json.dumps({"format": FORMAT, "key": key, "sha256": hashlib.sha256(body.encode()).hexdigest(),
                       "payload": payload}, sort_keys=True, separators=(",", ":"))


def read_entry(text: str, key: str):
    """(choice, names) from an entry stored under `key`, or None when it is malformed, of another
    format, stored under another key, or its content does not match its hash."""
    from powerfusion.pipeline.plan_codec import CodecError, decode
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("key") != key:
            return None
        body = json.dumps(doc["payload"], sort_keys=True, separators=(",", ":"))
        if hashlib.sha256(body.encode()).hexdigest() != doc.get("sha256"):
            return None
        tensors, stems, nodes, gname = doc["payload"]["names"]
        names = _Names(tuple(map(str, tensors)), tuple(map(str, stems)), tuple(map(str, nodes)), str(gname))
        choice = decode(doc["payload"]["choice"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, CodecError):
        return None
    from powerfusion.pipeline.choice import PlanChoice
    return (choice, names) if isinstance(choice, PlanChoice) and isinstance(choice.graph, GIRGraph) \
        and isinstance(choice.merged, GIRGraph) else None


def lookup(key: str, sub: Subgraph, graph: BasicGraph, t: TargetSpec, want_measured: bool = False):
    entry, source = _MEMO.get(key), "memo"
    if entry is None:
        entry = _read_disk(key)
        if entry is None:
            return None
        _MEMO[key] = entry
        source = "disk"
    choice, names = entry
    if want_measured and choice.measured_s is None:
        return None
    rebound = rebind(choice, names, sub, graph, t)
    if rebound is None:
        return None
    return replace(rebound, source=source)


def _read_disk(key: str):
    path = _path(key)
    try:
        if not path.is_file() or path.stat().st_size > MAX_ENTRY_BYTES:
            return None
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None   # unreadable: a miss
    return read_entry(text, key)


def rebind(choice, old: _Names, sub: Subgraph, graph: BasicGraph, t: TargetSpec):
    """The cached choice under this subgraph's names, or None when it does not carry over."""
    new = _names(sub, graph, t)
    if len(new.tensors) != len(old.tensors) or len(new.stems) != len(old.stems):
        return None
    if new == old:
        # same names, but the constants' values may differ (Elu alpha 1 vs 2 share a structure):
        # always bind this subgraph's own values
        consts = tuple((n, graph.constants[x]) for x, n in _constant_names(sub, graph, t))
        return replace(choice, graph=replace(choice.graph, constants=consts),
                       merged=replace(choice.merged, constants=consts))
    mapping: dict[str, str] = {}
    for a, b in zip(old.tensors, new.tensors):
        if mapping.setdefault(a, b) != b:
            return None
    stems = dict(zip(old.stems, new.stems))
    nodes = dict(zip(old.nodes, new.nodes))
    everything = [b.name for b in choice.graph.buffers] + [b.name for b in choice.merged.buffers]
    full = _extend(mapping, stems, everything)
    if full is None:
        return None
    consts = tuple((n, graph.constants[x]) for x, n in _constant_names(sub, graph, t))
    templates = tuple((nodes.get(n, n), label) for n, label in choice.merged.templates)

    def move(g: GIRGraph) -> GIRGraph:
        return replace(rename(g, full, nodes), name=new.graph, templates=templates, constants=consts)

    opt, merged = move(choice.graph), move(choice.merged)
    expect_in = {full.get(x, x) for x in choice.graph.inputs}
    if set(opt.inputs) != expect_in or len({b.name for b in opt.buffers}) != len(opt.buffers):
        return None
    return replace(choice, graph=opt, merged=merged, trace=())


def _constant_names(sub: Subgraph, graph: BasicGraph, t: TargetSpec):
    from powerfusion.templates.merge import MergePlan
    plan = MergePlan(sub, graph, t)
    return [(x, plan.names[x]) for x in dict.fromkeys(sub.inputs) if x in graph.constants]


def _extend(mapping: dict[str, str], stems: dict[str, str], names) -> dict[str, str] | None:
    """Template-local buffers are `<node stem>_<suffix>`, buffers created by rewrites
    `<old name>_<suffix>`: map each by its longest known prefix."""
    out = dict(mapping)
    prefixes = {**stems, **mapping}
    order = sorted(prefixes, key=len, reverse=True)
    for n in names:
        if n in out:
            continue
        stem = next((p for p in order if n.startswith(p + "_")), None)
        if stem is None:
            return None
        out[n] = prefixes[stem] + n[len(stem):]
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


def _rx(e: Expr, m: dict[str, str], seen: dict | None = None) -> Expr:
    """`e` with its loads' buffers renamed by `m`. A subexpression with no load is `e`'s own
    (nothing to rename), and one met again is renamed once: composed index maps share their
    subexpressions, and rebuilding them as a tree took longer than the search."""
    if isinstance(e, (Var, Const)) or not loads(e):
        return e
    seen = {} if seen is None else seen
    hit = seen.get(id(e))
    if hit is not None:
        return hit[1]
    if isinstance(e, BinOp):
        out = shared_node(BinOp, e.op, _rx(e.a, m, seen), _rx(e.b, m, seen))
    elif isinstance(e, Select):
        out = shared_node(Select, _rx(e.cond, m, seen), _rx(e.a, m, seen), _rx(e.b, m, seen))
    elif isinstance(e, Load):
        out = shared_node(Load, m.get(e.buffer, e.buffer), _rx(e.index, m, seen))
    else:
        raise TypeError(e)
    seen[id(e)] = (e, out)
    return out


def _no_constants(g: GIRGraph) -> GIRGraph:
    return replace(g, constants=())


# ---- housekeeping (powerfusion cache status | clear: runtime.plan_files) ---------------

def status(cache_dir=None) -> dict:
    from powerfusion.runtime import plan_files
    return plan_files.status(cache_dir)


def clear(cache_dir=None) -> tuple[int, list[str]]:
    """Delete every plan entry on disk and forget the decisions held in memory."""
    from powerfusion.runtime import plan_files
    _MEMO.clear()
    return plan_files.clear(cache_dir)
