"""Sync rules: promote data exchanged across a sync to the fastest level its exact scope allows.

Where a promoted buffer lives (the renderer's contract):
* LANE  -> a REGISTER buffer, identity layout over the writer's slice (index i*width + j);
           no sync is left (each lane reads what it wrote).
* WARP  -> a SHARED buffer with one region per unit (warp): index (u % upg)*count + i*width + j,
           followed by Sync(WARP). A renderer implements it as per-warp shared staging with
           __syncwarp (or, where it recognises the pattern, shuffles).
* BLOCK -> a SHARED buffer, one region per writing unit of the group, then Sync(BLOCK).
* DEVICE stays as it is.
The reader's index into the new buffer is the writer position of the element it reads
(patterns.writer_coords, checked exactly), so the layout is always the writer's identity.
"""
from __future__ import annotations

from dataclasses import replace

from powerfusion.gir.expr import U, I, J, Expr
from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Scope, Sync
from powerfusion.gir.scope import needed_scope
from powerfusion.rewrite.base import (Rewrite, matches, active_units, consts, device_barrier_between, device_syncs_between,
                                      fresh_name, index, interface, is_move, is_sync,
                                      loaded_anywhere, next_uid, op_loads, readers, register_layout_ok, writers)
from powerfusion.rewrite.patterns import compact, writer_coords

_TARGET = {Scope.LANE: Level.REGISTER, Scope.WARP: Level.SHARED, Scope.BLOCK: Level.SHARED}
_NEED = {Scope.LANE: "lane", Scope.WARP: "unit", Scope.BLOCK: "group"}


def _sync_buffers(op: GOp) -> list[str]:
    seen: list[str] = []
    for s in op.inputs + op.outputs:
        if s.buffer not in seen:
            seen.append(s.buffer)
    return seen


def _drop(op: GOp, name: str) -> GOp:
    return replace(op, inputs=tuple(s for s in op.inputs if s.buffer != name),
                   outputs=tuple(s for s in op.outputs if s.buffer != name))


def _position(scope: Scope, count: int, width: int, upg: int, u: Expr, i: Expr, j: Expr) -> Expr:
    pos = i * width + j
    return pos if scope == Scope.LANE else (u % upg) * count + pos


def _lane_identity(w: MemorySlice, r: MemorySlice, c) -> bool:
    probe = MemorySlice("_", Level.REGISTER, c.i * w.width + c.j, r.num, r.width, r.dtype)
    return register_layout_ok(probe)


@matches("sync")
def promote_sync(g: GIRGraph, at: int) -> Rewrite | None:
    """move ; sync(s0) ; move => move ; sync(s) ; move, s < s0 the exact scope (LANE: no sync)."""
    sync = g.ops[at]
    if not is_sync(sync):
        return None
    for name in _sync_buffers(sync):
        rw = _promote_once(g, at, name)
        if rw is not None:
            return rw
    for name in _sync_buffers(sync):
        rw = _promote_jointly(g, name)
        if rw is not None:
            return rw
    return None


# Promotions that failed, by everything they read (`_window_key`). The greedy driver tries every
# sync again after each rewrite elsewhere, and the search again for every plan sharing the
# exchange: the same promotion fails the same way each time (its exact scope and writer
# coordinates are memoised, but the graphs the joint promotion builds to find out are not).
_FAILED: dict = {}
_FAILED_SIZE = 8192


def _window_key(g: GIRGraph, group: list[str]) -> tuple | None:
    """What a promotion of `group`'s buffers reads of `g`: the gOperators from the first writer
    to the last reader of the group, and every gOperator elsewhere that writes, reads or syncs one
    of them (with its place relative to the window), the buffers, whether the model sees them or
    gathers from them, the parallel structure. None: a gOperator in the window gathers (its
    active units or slices may depend on constant data), so nothing is remembered."""
    spans = [_span(g, b) for b in group]
    if any(sp is None for sp in spans):
        return None
    lo, hi = min(sp[0] for sp in spans), max(sp[1] for sp in spans)
    window = g.ops[lo:hi + 1]
    if any(op_loads(op) for op in window):
        return None
    names = set(group)
    # the candidates: the group's writers and readers and the syncs (the index has them), not every op
    idx = index(g)
    near = set(idx.syncs)
    for b in group:
        near.update(idx.writers.get(b, ()))
        near.update(idx.readers.get(b, ()))
    outside = tuple((k - lo, g.ops[k]) for k in sorted(near) if not lo <= k <= hi
                    and any(sl.buffer in names for sl in g.ops[k].inputs + g.ops[k].outputs))
    flags = tuple((g.buffer(b), b in interface(g), loaded_anywhere(g, b)) for b in group)
    return tuple(group), window, outside, flags, g.parallel, lo


def _failed(key) -> bool:
    return key is not None and key in _FAILED


def _remember_failure(key) -> None:
    if key is None:
        return
    if len(_FAILED) >= _FAILED_SIZE:
        _FAILED.clear()
    _FAILED[key] = True


def _promote_once(g: GIRGraph, at: int, name: str) -> Rewrite | None:
    """`_promote`, not repeated where the same promotion failed before (same window, same sync
    position relative to it)."""
    key = _window_key(g, [name])
    key = None if key is None else (key[:-1], at - key[-1])
    if _failed(key):
        return None
    rw = _promote(g, at, name)
    if rw is None:
        _remember_failure(key)
    return rw


def _span(g: GIRGraph, name: str) -> tuple[int, int] | None:
    ws, rs = writers(g, name), readers(g, name)
    return (min(ws), max(rs)) if ws and rs else None


def crosses_kernels(g: GIRGraph) -> bool:
    """Does any register or shared buffer live across a DEVICE sync (invalid: kernels do not share them)?"""
    for b in g.buffers:
        span = _span(g, b.name) if b.level != Level.GLOBAL else None
        if span and device_barrier_between(g, span[0], span[1]):
            return True
    return False


def _promote_jointly(g: GIRGraph, name: str, limit: int = 16) -> Rewrite | None:
    """Several exchanges whose DEVICE syncs stand between each other's writer and reader
    (a consumer reading two tensors behind two syncs) are promoted together, or not at all."""
    group = [name]
    k = 0
    while k < len(group):
        span = _span(g, group[k])
        if span is None:
            return None
        for s in device_syncs_between(g, span[0], span[1]):
            names = _sync_buffers(g.ops[s])
            if not names:
                return None
            group += [n for n in names if n not in group]
        if len(group) > limit:
            return None
        k += 1
    if len(group) == 1:
        return None
    key = _window_key(g, group)
    key = None if key is None else ("jointly",) + key[:-1]
    if _failed(key):
        return None
    h, changed = g, []
    for b in group:
        at = next((k for k, op in enumerate(h.ops) if is_sync(op) and op.args.scope == Scope.DEVICE
                   and b in _sync_buffers(op)), None)
        rw = _promote(h, at, b, check_barrier=False) if at is not None else None
        if rw is None:
            _remember_failure(key)   # a kernel crossing below is not remembered: it reads the whole graph
            return None
        changed += [u for u in rw.changed if u in {op.uid for op in g.ops}]
        h = rw.apply(h)
    if crosses_kernels(h):
        return None
    return Rewrite(h.ops, h.buffers, tuple(dict.fromkeys(changed)))


def _promote(g: GIRGraph, at: int, name: str, check_barrier: bool = True) -> Rewrite | None:
    sync = g.ops[at]
    if name in interface(g) or loaded_anywhere(g, name):
        return None
    ws, rs = writers(g, name), readers(g, name)
    if len(ws) != 1 or not rs or ws[0] >= at or any(r < at for r in rs):
        return None
    w = ws[0]
    wop = g.ops[w]
    if not is_move(wop) or not all(is_move(g.ops[r]) for r in rs):
        return None
    if check_barrier and device_barrier_between(g, w, max(rs), frozenset({name})):
        return None   # a kernel boundary stays between writer and reader: data must stay in global memory
    wslice = wop.outputs[0]
    wunits = active_units(g, wop)
    P, data = g.parallel, consts(g)
    if wunits is None:
        return None
    scope, coords = Scope.LANE, []
    for r in rs:
        runits = active_units(g, g.ops[r])
        if runits is None:
            return None
        scope = max(scope, needed_scope(wslice, wunits, g.ops[r].inputs[0], runits, P, data))
    if scope >= sync.args.scope or _TARGET.get(scope, Level.GLOBAL) > g.buffer(name).level:
        return None
    if _TARGET[scope] == g.buffer(name).level and len(_sync_buffers(sync)) > 1:
        return None   # same level, a narrower sync beside the kept one: no progress (driver.measure)
    for r in rs:
        c = writer_coords(wslice, wunits, g.ops[r].inputs[0], active_units(g, g.ops[r]), P, _NEED[scope], data)
        if c is None:
            return None
        coords.append(c)
    if scope == Scope.LANE and not all(_lane_identity(wslice, g.ops[r].inputs[0], c) for r, c in zip(rs, coords)):
        scope = Scope.WARP   # same lane, other register position: stage through the warp's shared region
        if scope >= sync.args.scope:
            return None
    old = g.buffer(name)
    level, upg, count, width = _TARGET[scope], P.units_per_group, wslice.count, wslice.width
    new = Buffer(fresh_name(g, f"{name}_{scope.label}"), level,
                 count if scope == Scope.LANE else upg * count, old.dtype)
    new_w = MemorySlice(new.name, level, _position(scope, count, width, upg, U, I, J), wslice.num, width,
                        wslice.dtype, wslice.vec, wslice.valid, wslice.fill)
    ops = list(g.ops)
    uid = next_uid(g)
    ops[w] = replace(wop, outputs=(new_w,), uid=uid)
    new_rs = []
    for k, (r, c) in enumerate(zip(rs, coords)):
        rs_old = g.ops[r].inputs[0]
        rs_new = compact(replace(rs_old, buffer=new.name, level=level,
                                 index=_position(scope, count, width, upg, c.u, c.i, c.j)),
                         active_units(g, g.ops[r]), data)
        new_rs.append(rs_new)
        ops[r] = replace(g.ops[r], inputs=(rs_new,), uid=uid + 1 + k)
    # the old buffer's slices leave every sync; an emptied sync goes
    for k, op in enumerate(g.ops):
        if is_sync(op) and name in _sync_buffers(op):
            ops[k] = _drop(op, name)
    if scope != Scope.LANE:
        ops[at] = (GOp(Sync(scope), (new_w,), tuple(new_rs), origin=sync.origin, uid=uid + len(rs) + 1), ops[at])
    flat = []
    for k, op in enumerate(ops):
        for o in (op if isinstance(op, tuple) else (op,)):
            if is_sync(o) and not (o.inputs or o.outputs) and (g.ops[k].inputs or g.ops[k].outputs):
                continue
            flat.append(o)
    changed = tuple(g.ops[k].uid for k in [w, at, *rs])
    return Rewrite(tuple(flat), g.buffers + (new,), changed)


@matches("sync")
def forward_output(g: GIRGraph, at: int) -> Rewrite | None:
    """move(r -> x) ; sync ; move(x -> .) => move(r -> x), move(r -> t) ; sync(t) ; move(t -> .),
    t promoted: an output of the graph that the graph itself reads back after a sync (a residual
    sum that is both the block's output and its LayerNorm's input) is read from where its writer
    had it, while the store to the output stays. Fires only when t is promoted to a level below
    the sync's scope (else it would add a buffer and change nothing); x keeps its one writer."""
    sync = g.ops[at]
    if not is_sync(sync):
        return None
    outputs = set(g.outputs) - set(g.inputs) - {n for n, _ in g.constants}
    for name in _sync_buffers(sync):
        if name not in outputs or loaded_anywhere(g, name):
            continue
        ws, rs = writers(g, name), readers(g, name)
        if len(ws) != 1 or not rs or ws[0] >= at or any(r < at for r in rs):
            continue
        if not is_move(g.ops[ws[0]]) or not all(is_move(g.ops[r]) for r in rs):
            continue
        h, t_name = _forwarded(g, name, ws[0], rs)
        rw = _promote(h, at + 1, t_name)   # the extra store sits before the sync
        if rw is None:
            continue
        old = {op.uid for op in g.ops}
        changed = tuple(u for u in dict.fromkeys((g.ops[ws[0]].uid, sync.uid, *(g.ops[r].uid for r in rs),
                                                   *rw.changed)) if u in old)
        return Rewrite(rw.ops, rw.buffers, changed)
    return None


def _forwarded(g: GIRGraph, name: str, w: int, rs: list[int]) -> tuple[GIRGraph, str]:
    """g with a second store of x's writer into a new global buffer t, which the readers (and
    the syncs naming x after the writer) use instead of x."""
    old = g.buffer(name)
    t = Buffer(fresh_name(g, f"{name}_fwd"), Level.GLOBAL, old.size, old.dtype)
    uid = next_uid(g)
    wop = g.ops[w]
    store = replace(wop, outputs=(replace(wop.outputs[0], buffer=t.name),), uid=uid)
    ops = []
    for k, op in enumerate(g.ops):
        if k in rs:
            op = replace(op, inputs=tuple(replace(s, buffer=t.name) if s.buffer == name else s for s in op.inputs))
        elif is_sync(op) and k > w and name in _sync_buffers(op):
            op = replace(op, inputs=tuple(replace(s, buffer=t.name) if s.buffer == name else s for s in op.inputs),
                         outputs=tuple(replace(s, buffer=t.name) if s.buffer == name else s for s in op.outputs))
        ops.append(op)
        if k == w:
            ops.append(store)
    return replace(g, ops=tuple(ops), buffers=g.buffers + (t,)), t.name


@matches("sync")
def drop_unread_sync(g: GIRGraph, at: int) -> Rewrite | None:
    """sync(x) => nothing, when nothing after it reads x (or nothing before writes it)."""
    sync = g.ops[at]
    if not is_sync(sync) or not (sync.inputs or sync.outputs):
        return None
    names = {b.name for b in g.buffers}
    dead = [n for n in _sync_buffers(sync)
            if n not in names or not any(r > at for r in readers(g, n)) or not any(w < at for w in writers(g, n))]
    if not dead:
        return None
    op = sync
    for n in dead:
        op = _drop(op, n)
    ops = list(g.ops)
    if op.inputs or op.outputs:
        ops[at] = replace(op, uid=next_uid(g))
    else:
        del ops[at]
    return Rewrite(tuple(ops), g.buffers, (sync.uid,))


SYNC_RULES = {
    "move ; sync(s0) ; move => move ; sync(s) ; move": promote_sync,
    "sync(unread) => nothing": drop_unread_sync,
    "move(r -> out) ; sync ; move(out -> .) => move(r -> out), move(r -> t) ; sync ; move(t -> .)": forward_output,
}
