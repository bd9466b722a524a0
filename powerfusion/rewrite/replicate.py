"""Group reductions finished by every unit: `"combine ; sync(block) ; move => combine in every unit"`.

A BLOCK reduction (templates/ops_reduce.py, `reduce.block`) leaves, after the greedy rules,
two barriers per statistic: one before the group's first unit combines the units' partials
(and runs the scalar tail after it: a mean's scale, a variance's epsilon), and one more to
hand the result back to the other units through shared memory. Measured on the H200 (GPT-2's
residual + LayerNorm, 768-wide rows, fp16): 3.55 us for four warps per row against 3.17 us
for one warp (benchmarks/results/perfmodel-accuracy-models.md).

This rule removes the second barrier: every unit of the group runs the first unit's code
between the two barriers itself (the partials are in shared memory for all of them after the
first barrier), on private copies of that code's scratch buffers, and then reads its own copy
of the result. Semantics are unchanged: unit k of a group computes exactly what the first
unit u0 computed, because each of its slices is u0's slice with u replaced by u0
(`first = (u // G) * G`), scratch written in the window moved to a region of its own
(`+ (u % G) * size`), and no input of the window comes from a register written before it.

Like the one-pass rules (onepass.py) it is not applied greedily: it adds shared-memory reads
(G units read the partials instead of one) and register work, which the driver's invariant
(traffic never rises) forbids; what it saves is a barrier and its latency. `replicated_variant`
gives the search a second candidate and the cost model (per-barrier cost) chooses. Every
application is traced; the result is checked by the verifier in the search like any plan.

Preconditions, checked exactly:
* the BLOCK sync names one SHARED buffer B, written once (a move from registers) after the
  previous BLOCK sync s0 and read only after it (moves into registers), each read at an
  address that is the same for every unit of a group (evaluated over two groups);
* s0 exists and is a BLOCK sync; only narrower syncs stand between s0 and the sync;
* the window (s0, sync) writes no GLOBAL buffer except through moves kept as they are (a
  store of a result stays with the first unit), writes no buffer also written or read
  outside it (but B's readers), and reads no REGISTER buffer written before it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from powerfusion.gir.expr import Const, Expr, U, evaluate, substitute
from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Scope, Sync
from powerfusion.gir.scope import needed_scope
from powerfusion.gir.simplify import simplify
from powerfusion.rewrite.base import Rewrite, active_units, consts, is_move, is_sync, readers, writers

RULE = "combine ; sync(block) ; move => combine in every unit"


def replicated_variant(g: GIRGraph):
    """(graph, trace) with every BLOCK broadcast the rule can remove removed and the greedy
    rules run again (the narrowed syncs promoted, the moves merged), or None when none applies."""
    from powerfusion.rewrite.driver import TraceStep, optimise
    trace = []
    while True:
        rw = next((r for k in range(len(g.ops)) if (r := replicate_broadcast(g, k)) is not None), None)
        if rw is None:
            break
        new = rw.apply(g)
        trace.append(TraceStep(RULE, g, new, rw.changed))
        g = new
    if not trace:
        return None
    out, more = optimise(g)
    return out, trace + list(more)


def replicate_broadcast(g: GIRGraph, at: int) -> Rewrite | None:
    """The rule at the BLOCK sync `at` (module doc), or None where a precondition fails."""
    sync = g.ops[at]
    if not is_sync(sync) or sync.args.scope != Scope.BLOCK:
        return None
    names = {s.buffer for s in sync.inputs + sync.outputs}
    if len(names) != 1:
        return None
    (b,) = names
    if g.buffer(b).level != Level.SHARED:
        return None
    ws, rs = writers(g, b), readers(g, b)
    if len(ws) != 1 or not rs or ws[0] > at or any(r < at for r in rs):
        return None
    s0 = next((k for k in range(ws[0] - 1, -1, -1) if is_sync(g.ops[k]) and g.ops[k].args.scope >= Scope.BLOCK), None)
    if s0 is None or g.ops[s0].args.scope != Scope.BLOCK:
        return None
    if any(is_sync(g.ops[k]) and g.ops[k].args.scope >= Scope.BLOCK for k in range(ws[0] + 1, at)):
        return None
    window = [k for k in range(s0 + 1, at) if not is_sync(g.ops[k])]
    if not all(is_move(g.ops[r]) and g.ops[r].outputs[0].level == Level.REGISTER for r in rs):
        return None
    G = g.parallel.units_per_group
    if G == 1 or not all(_same_in_group(g.ops[r].inputs[0].index, G, g) for r in rs):
        return None
    scratch = _scratch(g, window, s0, at, b, set(rs))
    if scratch is None:
        return None
    return _rewrite(g, at, window, scratch, b, rs, G)


def _scratch(g: GIRGraph, window: list[int], s0: int, at: int, b: str, b_readers: set[int]) -> set[str] | None:
    """Buffers the window writes (its private scratch), or None where one is written or read
    outside the window (B: read by its readers only), or a register input comes from before."""
    inside = set(window)
    out: set[str] = set()
    for k in window:
        op = g.ops[k]
        if _kept(op):
            continue
        for s in op.outputs:
            if s.level == Level.GLOBAL:
                return None
            out.add(s.buffer)
    for name in out:
        ws, rs = set(writers(g, name)), set(readers(g, name))
        allowed = inside | (b_readers | {at} if name == b else set())
        if not ws <= inside or not rs <= allowed:
            return None
    for k in window:
        for s in g.ops[k].inputs:
            if s.level == Level.REGISTER and s.buffer not in out:
                return None   # a value of this unit from before the window: not the first unit's
            if s.level != Level.REGISTER and s.buffer not in out and \
                    any(s0 < w < at for w in writers(g, s.buffer)):
                return None   # written in the window by a kept store: the other units would race it
    return out


def _kept(op: GOp) -> bool:
    """A store to global memory stays with the unit(s) that ran it (one writer per element)."""
    return is_move(op) and op.outputs[0].level == Level.GLOBAL and op.inputs[0].level == Level.REGISTER


def _rewrite(g: GIRGraph, at: int, window: list[int], scratch: set[str], b: str, rs: list[int], G: int) -> Rewrite:
    first = {"u": (U // G) * G}
    size = {n: g.buffer(n).size for n in scratch if g.buffer(n).level == Level.SHARED}
    own = {n: (U % G) * sz for n, sz in size.items()}

    units = g.parallel.units

    def tidy(e: Expr, s: MemorySlice | None = None) -> Expr:
        # u // G * G % G is 0: folded, so the sync rules see the first unit's plain pattern
        bounds = {"u": (0, units), "i": (0, s.num if s else 1), "j": (0, s.width if s else 1)}
        return simplify(e, bounds) if s else simplify(e, {"u": (0, units)})

    def moved(s: MemorySlice) -> MemorySlice:
        idx = tidy(substitute(s.index, first), s)
        if s.buffer in own:
            idx = idx + own[s.buffer]
        elif s.level == Level.REGISTER:
            idx = s.index   # identity layouts hold no u
        valid = _true_to_none(tidy(substitute(s.valid, first), s)) if s.valid is not None else None
        return replace(s, index=idx, valid=valid)

    ops = list(g.ops)
    changed = []
    for k in window:
        op = ops[k]
        if _kept(op):
            continue
        ops[k] = replace(op, inputs=tuple(map(moved, op.inputs)), outputs=tuple(map(moved, op.outputs)),
                         guard=_true_to_none(tidy(substitute(op.guard, first))) if op.guard is not None else None)
        changed.append(op.uid)
    for r in rs:
        op = ops[r]
        src = op.inputs[0]
        # every unit of a group read the first unit's copy (checked): each now reads its own
        ops[r] = replace(op, inputs=(replace(src, index=tidy(substitute(src.index, first), src) + own[b]),))
        changed.append(op.uid)
    w = writers(g, b)[0]
    wslice = ops[w].outputs[0]
    buffers = tuple(replace(x, size=x.size * G) if x.name in size else x for x in g.buffers)
    h = replace(g, ops=tuple(ops), buffers=buffers)
    scope = Scope.LANE
    wunits = active_units(h, ops[w])
    for r in rs:
        scope = max(scope, needed_scope(wslice, wunits, ops[r].inputs[0], active_units(h, ops[r]),
                                        h.parallel, consts(h)))
    ops[at] = replace(g.ops[at], args=Sync(max(scope, Scope.WARP)), inputs=(wslice,),
                      outputs=tuple(ops[r].inputs[0] for r in rs))
    changed.append(g.ops[at].uid)
    return Rewrite(tuple(ops), buffers, tuple(changed))


def _true_to_none(e: Expr) -> Expr | None:
    return None if isinstance(e, Const) and e.value else e


def _same_in_group(index: Expr, G: int, g: GIRGraph) -> bool:
    """Does every unit of a group read the same address at each (i, j)? Evaluated on the
    first and last two groups (templates give every group one pattern up to its offset)."""
    groups = sorted({0, 1, max(0, g.parallel.units // G - 1)})
    units = np.array([q * G + k for q in groups for k in range(G) if q * G + k < g.parallel.units])
    if not len(units):
        return False
    i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    data = consts(g)
    try:
        mine = [np.broadcast_to(evaluate(index, {"u": int(u), "i": i, "j": j}, data), i.shape) for u in units]
        lead = [np.broadcast_to(evaluate(index, {"u": int(u // G * G), "i": i, "j": j}, data), i.shape)
                for u in units]
    except KeyError:
        return False
    return all(np.array_equal(a, c) for a, c in zip(mine, lead))
