"""Merge 1 through an intermediate with several writers (concat) and several readers (split).

(move(a1 -> t) ‖ ... ‖ move(aW -> t)) ; move(t -> b1) ‖ ... ‖ move(t -> bR)
  => for every reader and every writer it reads from: move(a_w -> b_r)

Each new move takes the reader's elements that writer w wrote: a condition on the unit
(folded into the guard) or on the element (a valid mask on both slices: the source is not
read and the destination not written elsewhere). The condition is chosen among simple
candidates and checked against the exact element-by-element answer over every reader unit; a
reader larger than patterns.SAMPLE_CAP elements (where other rules look at a sample) is left
alone, since a sampled check accepted a wrong split (see compose_split). The intermediate
disappears, so the rule fires only when it does not add gOperators (W*R <= W+R).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from powerfusion.gir.expr import Expr, binop, substitute, variables
from powerfusion.gir.ir import GIRGraph, GOp, Level, MemorySlice
from powerfusion.rewrite.base import (Rewrite, matches, if_not_worse, active_units, consts, device_barrier_between, interface, is_move,
                                      loaded_anywhere, next_uid, readers, register_layout_ok, written_between,
                                      without_syncs_on, writers)
from powerfusion.rewrite.patterns import Coords, sampled_units, compact, composition_need, covering_coords, eval_over


def _and(*es):
    out = None
    for e in es:
        if e is not None:
            out = e if out is None else binop("and", out, e)
    return out


def _conditions(w: MemorySlice, wop: GOp, r: MemorySlice, c: Coords):
    """Candidate element conditions 'writer w wrote the element read', simplest first."""
    guard = substitute(wop.guard, {"u": c.u}) if wop.guard is not None else None
    ranges = _and(binop("le", 0, c.i), c.i.lt(w.num), binop("le", 0, c.j), c.j.lt(w.width))
    exact = _and(guard, ranges, binop("eq", c.at(w.index), r.index),
                 c.at(w.valid) if w.valid is not None else None)
    return [None, guard, ranges, _and(guard, ranges), exact]


def _pick(cands, covered, units, rvalid: np.ndarray, r: MemorySlice, buffers):
    """The first candidate condition that holds exactly where the writer covers the reader;
    `rvalid`: the reader's valid mask over `units` (the caller has it already)."""
    for e in cands:
        try:
            v = eval_over(e, units, r.num, r.width, buffers).astype(bool).reshape(len(units), -1)
        except KeyError:
            continue
        if np.array_equal(v & rvalid, covered):
            return e, True
    return None, False


@matches("move")
def compose_split(g: GIRGraph, at: int) -> Rewrite | None:
    """(move ‖ move) ; (move ‖ move) => move ‖ move ‖ ... through a concat/split intermediate."""
    op = g.ops[at]
    if not is_move(op):
        return None
    t = op.inputs[0].buffer
    ws, rs = writers(g, t), readers(g, t)
    if len(ws) < 2 or t in interface(g) or loaded_anywhere(g, t) or at != rs[0]:
        return None
    if len(ws) * len(rs) > len(ws) + len(rs) or max(ws) > min(rs):
        return None
    if not all(is_move(g.ops[k]) for k in ws + rs):
        return None
    data, P = consts(g), g.parallel
    units = {k: active_units(g, g.ops[k]) for k in ws + rs}
    if any(u is None for u in units.values()):
        return None
    tdt = g.buffer(t).dtype
    new_ops: dict[int, list[GOp]] = {}
    uids = iter(range(next_uid(g), next_uid(g) + len(ws) * len(rs)))
    for r in rs:
        rop = g.ops[r]
        p2, pb = rop.inputs[0], rop.outputs[0]
        # the reader units the element-by-element check looks at: all of them up to SAMPLE_CAP
        # elements, beyond it a fixed sample with digit probes (patterns.sampled_units), so that the
        # rule's cost does not grow with the tensor
        check = sampled_units(units[r], p2.count, exprs=(p2.index, pb.index) + tuple(g.ops[w].outputs[0].index for w in ws))
        if len(check) < len(units[r]):
            # a sample proves nothing here: the writers' coverage and the chosen conditions held on
            # it and were wrong on units outside it (swin3d_b's shifted-window roll, a 2x56x56x128
            # concat of concats: 1152 corner elements read from the wrong writer). Only an
            # element-by-element check of every reader unit makes the rule exact.
            return None
        rvalid = eval_over(p2.valid, check, p2.num, p2.width, data).astype(bool).reshape(len(check), -1)
        bvalid = eval_over(pb.valid, check, pb.num, pb.width, data).astype(bool).reshape(len(check), -1)
        if np.any(bvalid & ~rvalid):
            return None      # the reader writes fill there: no writer's move would
        total = np.zeros_like(rvalid, dtype=np.int64)
        parts = []
        for w in ws:
            wop = g.ops[w]
            pa, p1 = wop.inputs[0], wop.outputs[0]
            if g.buffer(pa.buffer).dtype != tdt or written_between(g, pa.buffer, w, r):
                return None
            if pa.level != Level.GLOBAL and device_barrier_between(g, w, r, frozenset({t})):
                return None
            hit = covering_coords(p1, units[w], p2, check, P, composition_need(pa.level, p1.level), data)
            if hit is None:
                return None
            c, covered = hit
            total += covered
            if not covered.any():
                continue
            cond, ok = _pick(_conditions(p1, wop, p2, c), covered, check, rvalid, p2, data)
            if not ok:
                return None
            parts.append(_split_move(rop, wop, c, cond, next(uids), units[r], data))
            if parts[-1] is None:
                return None
        if not np.array_equal(total, rvalid.astype(np.int64)):
            return None      # some element read by none or by two writers
        new_ops[r] = parts
    ops = []
    for k, o in enumerate(g.ops):
        if k in ws:
            continue
        ops.extend(new_ops.get(k, [o]))
    return if_not_worse(g, Rewrite(tuple(without_syncs_on(ops, t)), g.buffers, tuple(g.ops[k].uid for k in ws + rs)))


def _split_move(rop: GOp, wop: GOp, c: Coords, cond: Expr | None, uid: int, units, buffers) -> GOp | None:
    pa, p2, pb = wop.inputs[0], rop.inputs[0], rop.outputs[0]
    va = c.at(pa.valid) if pa.valid is not None else None
    if va is not None and p2.valid is not None and pa.fill != p2.fill:
        return None
    fill = pa.fill if va is not None else p2.fill
    guard, mask = rop.guard, None
    if cond is not None and variables(cond) <= {"u"}:
        guard = _and(rop.guard, cond)
    elif cond is not None:
        mask = cond
    src = compact(MemorySlice(pa.buffer, pa.level, c.at(pa.index), p2.num, p2.width, pa.dtype, p2.vec,
                              _and(va, p2.valid, mask), fill), units, buffers)
    if not register_layout_ok(src):
        return None
    dst = replace(pb, valid=_and(pb.valid, mask))
    return GOp(rop.args, (src,), (dst,), guard, rop.origin, uid)

