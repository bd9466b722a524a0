"""What every rewrite rule shares: the `Rewrite` a rule returns, and read-only queries on a graph.

A rule is `rule(graph, at) -> Rewrite | None`: it looks at the gOperator at index `at`
(and whatever it needs around it) and returns the whole replacement schedule; the
driver (driver.py) applies it. Rules never edit a graph in place. `@matches(kind, ...)`
declares the gOperator kinds a rule can fire on at `at`: the driver tries a rule only at
gOperators of those kinds (rules indexed by the kind they match, as tinygrad indexes its
PatternMatcher by op).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from powerfusion.gir.expr import I, J, evaluate, loads, variables
from powerfusion.gir.traffic import not_worse, traffic, traffic_after
from powerfusion.gir.ir import KIND_OF, Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Scope, Sync

KINDS = frozenset(KIND_OF.values())


def matches(*kinds: str):
    """Declare the gOperator kinds a rule can fire on at its position (`rule.kinds`); a rule
    without a declaration is tried at every gOperator. tests/unit/rewrite/test_dispatch.py checks
    that a rule never fires on a kind it does not declare."""
    unknown = set(kinds) - KINDS
    if unknown or not kinds:
        raise ValueError(f"@matches: unknown gOperator kind(s) {sorted(unknown)}; known: {sorted(KINDS)}")

    def mark(rule):
        rule.kinds = frozenset(kinds)
        return rule
    return mark


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A replacement schedule (and buffer table) for the graph the rule looked at."""
    ops: tuple[GOp, ...]
    buffers: tuple[Buffer, ...]
    changed: tuple[int, ...]   # uids of the old graph's gOperators this rewrite replaced or removed
    _applied: tuple | None = field(default=None, init=False, compare=False, hash=False, repr=False)   # (graph, result)

    def apply(self, graph: GIRGraph) -> GIRGraph:
        """The new graph; buffers nothing uses any more are dropped (as GIRGraph.with_ops does).
        Remembered on the rewrite: a rule's own traffic check (`if_not_worse`) applies it, and
        the driver applies it to the same graph right after."""
        if self._applied is not None and self._applied[0] is graph:
            return self._applied[1]
        keep = set(graph.inputs) | set(graph.outputs) | {n for n, _ in graph.constants}
        for op in self.ops:
            keep |= op_facts(op).names
        out = replace(graph, ops=self.ops, buffers=tuple(b for b in self.buffers if b.name in keep))
        object.__setattr__(self, "_applied", (graph, out))
        return out


def if_not_worse(g: GIRGraph, rw: "Rewrite") -> "Rewrite | None":
    """The rewrite, unless it would raise modelled global or total bytes."""
    return rw if not_worse(index(g).traffic, traffic_after(g, index(g).traffic, rw.apply(g))) else None


def interface(g: GIRGraph) -> set[str]:
    """Buffers the rest of the model sees: never renamed, removed or relocated."""
    return index(g).interface


def _slice_loads(s: MemorySlice) -> frozenset[str]:
    out = loads(s.index)
    return out | loads(s.valid) if s.valid is not None else out


_OP_LOADS: dict[int, tuple[GOp, frozenset[str]]] = {}


def op_loads(op: GOp) -> frozenset[str]:
    """Buffers an op reads through gather expressions (indices, masks, guard); remembered per
    op object (ops are immutable and shared between the graphs of a rewrite sequence)."""
    hit = _OP_LOADS.get(id(op))
    if hit is not None and hit[0] is op:
        return hit[1]
    out = frozenset().union(*(_slice_loads(s) for s in op.inputs + op.outputs))
    out = out | loads(op.guard) if op.guard is not None else out
    if len(_OP_LOADS) > 200_000:
        _OP_LOADS.clear()
    _OP_LOADS[id(op)] = (op, out)
    return out


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What one gOperator contributes to a graph's index, its termination measure and the
    buffers a graph keeps: worked out once per op object (ops are immutable and shared between
    the graphs of a rewrite sequence, so a step meets again all but the ops it changed)."""
    sync: bool
    device_sync: bool
    written: tuple[str, ...]          # output buffers (a sync's: none)
    read: tuple[str, ...]             # buffers read as data or gathered, first appearance order (a sync's: none)
    gathered: frozenset[str]          # buffers read through gather expressions
    move_source: str | None           # a move's source buffer
    names: frozenset[str]             # every buffer the op names: inputs, outputs, gathered
    weight: int                       # sum of 4 ** level over the slices (a sync: 0)
    sync_weight: int                  # 4 ** scope of a sync (others: 0)
    sync_slices: int                  # a sync's slices (others: 0)
    elementwise: bool


_OP_FACTS: dict[int, tuple[GOp, OpFacts]] = {}


def op_facts(op: GOp) -> OpFacts:
    hit = _OP_FACTS.get(id(op))
    if hit is not None and hit[0] is op:
        return hit[1]
    args = op.args
    gathered = op_loads(op)
    names = frozenset([s.buffer for s in op.inputs] + [s.buffer for s in op.outputs]) | gathered
    if type(args) is Sync:
        facts = OpFacts(True, args.scope == Scope.DEVICE, (), (), gathered, None, names, 0,
                        4 ** int(args.scope), len(op.inputs) + len(op.outputs), False)
    else:
        read = tuple(dict.fromkeys([s.buffer for s in op.inputs] + sorted(gathered)))
        facts = OpFacts(False, False, tuple(s.buffer for s in op.outputs), read, gathered,
                        op.inputs[0].buffer if type(args) is Move else None, names,
                        sum(4 ** int(s.level) for s in op.inputs + op.outputs), 0, 0,
                        type(args) is Elementwise)
    if len(_OP_FACTS) > 200_000:
        _OP_FACTS.clear()
    _OP_FACTS[id(op)] = (op, facts)   # held with its facts, so its id stays its own
    return facts


class GraphIndex:
    """Who writes, reads and gathers from each buffer, built once per (immutable) graph."""

    def __init__(self, g: GIRGraph):
        self.writers: dict[str, list[int]] = {}
        self.readers: dict[str, list[int]] = {}
        self.loaded: set[str] = set()
        self.device_syncs: list[int] = []
        self.syncs: list[int] = []   # every sync, whatever its scope
        self.moves_reading: dict[str, list[int]] = {}   # by source buffer
        self.interface = set(g.inputs) | set(g.outputs) | {n for n, _ in g.constants}
        self._traffic: dict[str, int] | None = None
        self._graph = g
        # built for every graph the rewriter makes (Swin-T's search: 22,000), so the loop is kept
        # tight: what each op contributes is worked out once per op object (op_facts)
        writers, readers, moves, syncs, loaded = self.writers, self.readers, self.moves_reading, self.syncs, self.loaded
        for k, op in enumerate(g.ops):
            f = op_facts(op)
            if f.sync:
                syncs.append(k)
                if f.device_sync:
                    self.device_syncs.append(k)
                continue
            for name in f.written:
                writers.setdefault(name, []).append(k)
            if f.gathered:
                loaded |= f.gathered
            for name in f.read:
                readers.setdefault(name, []).append(k)
            if f.move_source is not None:
                moves.setdefault(f.move_source, []).append(k)

    @property
    def traffic(self) -> dict[str, int]:
        if self._traffic is None:
            self._traffic = traffic(self._graph)
        return self._traffic


_INDEX: OrderedDict[int, tuple[GIRGraph, GraphIndex]] = OrderedDict()


def index(g: GIRGraph) -> GraphIndex:
    hit = _INDEX.get(id(g))
    if hit is not None and hit[0] is g:
        _INDEX.move_to_end(id(g))
        return hit[1]
    idx = GraphIndex(g)
    _INDEX[id(g)] = (g, idx)
    if len(_INDEX) > 16:
        _INDEX.popitem(last=False)
    return idx


def writers(g: GIRGraph, name: str) -> list[int]:
    return index(g).writers.get(name, [])


def readers(g: GIRGraph, name: str) -> list[int]:
    """Ops that read `name` as data or through a gather expression (syncs excluded)."""
    return index(g).readers.get(name, [])


def loaded_anywhere(g: GIRGraph, name: str) -> bool:
    return name in index(g).loaded


def is_move(op: GOp) -> bool:
    return isinstance(op.args, Move)


def is_sync(op: GOp) -> bool:
    return isinstance(op.args, Sync)


def written_between(g: GIRGraph, name: str, lo: int, hi: int) -> bool:
    """Does any op with index in (lo, hi) write `name`?"""
    return any(lo < k < hi for k in writers(g, name))


def device_syncs_between(g: GIRGraph, lo: int, hi: int) -> list[int]:
    ds = index(g).device_syncs
    return ds[bisect_right(ds, lo):bisect_left(ds, hi)]


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
    if not any(s.buffer == old for s in op.inputs + op.outputs):
        return op     # untouched ops stay the same objects (per-op caches keep hitting)

    def fix(s: MemorySlice) -> MemorySlice:
        return replace(s, buffer=new) if s.buffer == old else s
    return replace(op, inputs=tuple(map(fix, op.inputs)), outputs=tuple(map(fix, op.outputs)))


def register_layout_ok(s: MemorySlice) -> bool:
    """Register slices use the identity layout (what a renderer spreads over lanes)."""
    if s.level != Level.REGISTER:
        return True
    return s.index == I * s.width + J or (s.num == 1 and s.index == J) or (s.width == 1 and s.index == I)


def in_lane_pattern(s: MemorySlice) -> bool:
    """A register slice addressing its tile other than element (i, j) at i * width + j, by
    value (an in-lane window move's side: templates/ops_strip.py)."""
    if s.level != Level.REGISTER or register_layout_ok(s) or variables(s.index) - {"i", "j"}:
        return False
    i, j = np.meshgrid(np.arange(s.num), np.arange(s.width), indexing="ij")
    return not np.array_equal(np.broadcast_to(evaluate(s.index, {"i": i, "j": j}), i.shape), i * s.width + j)


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


def device_barrier_between(g: GIRGraph, lo: int, hi: int, ignore: frozenset[str] = frozenset()) -> bool:
    """Is there a kernel boundary in (lo, hi) that stays (guards more than `ignore`)?"""
    for k in device_syncs_between(g, lo, hi):
        names = {s.buffer for s in g.ops[k].inputs + g.ops[k].outputs}
        if not names or names - ignore:
            return True
    return False


def without_syncs_on(ops, name: str) -> list[GOp]:
    """The schedule with `name` removed from every sync, and syncs left guarding nothing removed
    (a rule that bypasses an intermediate removes its kernel boundary in the same step).
    A WARP or BLOCK sync is a barrier for every buffer: one left guarding nothing stays when a
    shared buffer written since the previous sync of its scope is read after it (another
    buffer's accesses relied on the barrier), now naming that buffer's slices."""
    out = []
    for k, op in enumerate(ops):
        if isinstance(op.args, Sync) and any(s.buffer == name for s in op.inputs + op.outputs):
            op = replace(op, inputs=tuple(s for s in op.inputs if s.buffer != name),
                         outputs=tuple(s for s in op.outputs if s.buffer != name))
            if not (op.inputs or op.outputs):
                kept = _still_a_barrier(ops, k, op, name)
                if kept is None:
                    continue
                op = kept
        out.append(op)
    return out


def _still_a_barrier(ops, k: int, sync: GOp, gone: str) -> GOp | None:
    """The sync at k guarding the shared buffers written before it (since the previous sync of
    at least its scope) and read after it (until the next one), or None when there are none."""
    scope = sync.args.scope
    if scope not in (Scope.WARP, Scope.BLOCK):
        return None
    written: dict[str, MemorySlice] = {}
    for op in reversed(ops[:k]):
        if isinstance(op.args, Sync) and op.args.scope >= scope:
            break
        for s in op.outputs:
            if s.level == Level.SHARED and s.buffer != gone:
                written.setdefault(s.buffer, s)
    read: dict[str, MemorySlice] = {}
    for op in ops[k + 1:]:
        if isinstance(op.args, Sync) and op.args.scope >= scope:
            break
        for s in op.inputs:
            if s.buffer in written:
                read.setdefault(s.buffer, s)
    if not read:
        return None
    return replace(sync, inputs=tuple(written[b] for b in read), outputs=tuple(read.values()))
