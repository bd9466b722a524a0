"""What every rewrite rule shares: the `Rewrite` a rule returns, and read-only queries on a graph.

A rule is `rule(graph, at) -> Rewrite | None`: it looks at the gOperator at index `at`
(and whatever it needs around it) and returns the whole replacement schedule; the
driver (driver.py) applies it. Rules never edit a graph in place.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from powerfusion.gir.expr import I, J, loads
from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Move, Sync


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A replacement schedule (and buffer table) for the graph the rule looked at."""
    ops: tuple[GOp, ...]
    buffers: tuple[Buffer, ...]
    changed: tuple[int, ...]   # uids of the old graph's gOperators this rewrite replaced or removed

    def apply(self, graph: GIRGraph) -> GIRGraph:
        return graph.with_ops(self.ops, self.buffers)


def interface(g: GIRGraph) -> set[str]:
    """Buffers the rest of the model sees: never renamed, removed or relocated."""
    return set(g.inputs) | set(g.outputs) | {n for n, _ in g.constants}


def _slice_loads(s: MemorySlice) -> frozenset[str]:
    out = loads(s.index)
    return out | loads(s.valid) if s.valid is not None else out


def op_loads(op: GOp) -> frozenset[str]:
    """Buffers an op reads through gather expressions (indices, masks, guard)."""
    out = frozenset().union(*(_slice_loads(s) for s in op.inputs + op.outputs))
    return out | loads(op.guard) if op.guard is not None else out


def writers(g: GIRGraph, name: str) -> list[int]:
    return [k for k, op in enumerate(g.ops) if not is_sync(op) and any(s.buffer == name for s in op.outputs)]


def readers(g: GIRGraph, name: str) -> list[int]:
    """Ops that read `name` as data or through a gather expression (syncs excluded)."""
    return [k for k, op in enumerate(g.ops)
            if not is_sync(op) and (any(s.buffer == name for s in op.inputs) or name in op_loads(op))]


def loaded_anywhere(g: GIRGraph, name: str) -> bool:
    return any(name in op_loads(op) for op in g.ops)


def is_move(op: GOp) -> bool:
    return isinstance(op.args, Move)


def is_sync(op: GOp) -> bool:
    return isinstance(op.args, Sync)


def written_between(g: GIRGraph, name: str, lo: int, hi: int) -> bool:
    """Does any op with index in (lo, hi) write `name`?"""
    return any(lo < k < hi for k in writers(g, name))


def fresh_name(g: GIRGraph, base: str) -> str:
    names = {b.name for b in g.buffers}
    if base not in names:
        return base
    k = 1
    while f"{base}_{k}" in names:
        k += 1
    return f"{base}_{k}"


def next_uid(g: GIRGraph) -> int:
    return max((op.uid for op in g.ops), default=0) + 1


def with_uids(ops, start: int) -> tuple[GOp, ...]:
    """New ops get fresh uids (uids are identity for traces, not part of equality)."""
    return tuple(replace(op, uid=start + k) for k, op in enumerate(ops))


def rename_buffer(op: GOp, old: str, new: str) -> GOp:
    """The op with every slice of buffer `old` pointing at `new` (same level and pattern)."""
    def fix(s: MemorySlice) -> MemorySlice:
        return replace(s, buffer=new) if s.buffer == old else s
    return replace(op, inputs=tuple(map(fix, op.inputs)), outputs=tuple(map(fix, op.outputs)))


def register_layout_ok(s: MemorySlice) -> bool:
    """Register slices use the identity layout (what a renderer spreads over lanes)."""
    if s.level != Level.REGISTER:
        return True
    return s.index == I * s.width + J or (s.num == 1 and s.index == J) or (s.width == 1 and s.index == I)


def same_guard(a: GOp, b: GOp) -> bool:
    return a.guard == b.guard


def consts(g: GIRGraph) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in g.constants}


def active_units(g: GIRGraph, op: GOp) -> np.ndarray | None:
    """Units running `op`, or None when its guard depends on runtime data."""
    try:
        return op.active_units(g.parallel.units, consts(g))
    except KeyError:
        return None
