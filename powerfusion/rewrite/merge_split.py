"""Merge 1 through an intermediate with several writers (concat) and several readers (split).

(move(a1 -> t) ‖ ... ‖ move(aW -> t)) ; move(t -> b1) ‖ ... ‖ move(t -> bR)
  => for every reader and every writer it reads from: move(a_w -> b_r)

Each new move takes the reader's elements that writer w wrote: a condition on the unit
(folded into the guard) or on the element (a valid mask on both slices: the source is not
read and the destination not written elsewhere). The condition is chosen among simple
candidates and checked against the exact element-by-element answer over every reader unit.
A reader larger than patterns.SAMPLE_CAP elements (where other rules look at a sample) gets its
coordinates and conditions chosen on the sample, then confirmed element by element over every
unit (`_confirmed`, in chunks; readers past EXACT_CAP are left alone): a sampled check alone
accepted a wrong split (see compose_split), and refusing every large reader left ShuffleNet-size
channel shuffles as two kernels (twice the traffic). The intermediate disappears, so the rule
fires only when it does not add gOperators (W*R <= W+R).
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from powerfusion.gir.expr import J, U, Expr, binop, evaluate, loads, substitute, variables
from powerfusion.gir.ir import GIRGraph, GOp, Level, MemorySlice, units_key
from powerfusion.gir.periodic import deciding_units
from powerfusion.rewrite.base import (Rewrite, matches, if_not_worse, active_units, consts, device_barrier_between, interface, is_move,
                                      loaded_anywhere, next_uid, readers, register_layout_ok, written_between,
                                      without_syncs_on, writers)
from powerfusion.rewrite.patterns import (Coords, sampled_units, compact, composition_need, covering_coords, eval_over,
                                          conjuncts, evaluate_coords, grid, injective_exactly)


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
    if any(e is not None and loads(e) for e in cands):   # depends on constant data: not memoised
        return _pick_now(cands, covered, units, rvalid, r, buffers)
    # asked again for every plan that keeps the concat/split, as covering_coords is
    key = (tuple(cands), r.num, r.width, units_key(units), _bits_key(covered), _bits_key(rvalid))
    hit = _PICKED.get(key)
    if hit is None:
        if len(_PICKED) >= 1024:
            _PICKED.clear()
        hit = _PICKED[key] = _pick_now(cands, covered, units, rvalid, r, buffers)
    return hit


_PICKED: dict = {}


def _bits_key(a: np.ndarray) -> tuple:
    return a.shape, hashlib.blake2b(np.packbits(a.reshape(-1)).data, digest_size=16).digest()


def _pick_now(cands, covered, units, rvalid: np.ndarray, r: MemorySlice, buffers):
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
    # every reader's choice is checked before any composed move is built: a check that fails
    # (an element no writer covers, a later reader's) makes the moves built so far wasted work,
    # and building them (the refits) is most of the rule's cost
    choices: list[tuple[int, list, bool]] = []
    for r in rs:
        rop = g.ops[r]
        p2, pb = rop.inputs[0], rop.outputs[0]
        # the reader units the element-by-element check looks at: all of them up to SAMPLE_CAP
        # elements, beyond it a fixed sample with digit probes (patterns.sampled_units), so that the
        # rule's cost does not grow with the tensor
        check = sampled_units(units[r], p2.count, exprs=(p2.index, pb.index) + tuple(g.ops[w].outputs[0].index for w in ws))
        sampled = len(check) < len(units[r])
        if sampled and len(units[r]) * p2.count > EXACT_CAP:
            return None
        rvalid, bvalid = _valid_over(p2, check, data), _valid_over(pb, check, data)
        if np.any(bvalid & ~rvalid):
            return None      # the reader writes fill there: no writer's move would
        total = np.zeros_like(rvalid, dtype=np.int64)
        chosen = []
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
                chosen.append((w, c, False))
                continue
            cond, ok = _pick(_conditions(p1, wop, p2, c), covered, check, rvalid, p2, data)
            if not ok:
                return None
            chosen.append((w, c, cond))
        if not np.array_equal(total, rvalid.astype(np.int64)):
            return None      # some element read by none or by two writers
        if sampled and not _confirmed(g, r, chosen, units, data):
            return None
        choices.append((r, chosen, sampled))
    new_ops: dict[int, list[GOp]] = {}
    uids = iter(range(next_uid(g), next_uid(g) + len(ws) * len(rs)))
    for r, chosen, sampled in choices:
        parts = []
        for w, c, cond in chosen:
            if cond is False:
                continue
            parts.append(_split_move(g.ops[r], g.ops[w], c, cond, next(uids), units[r], data, exact=sampled))
            if parts[-1] is None:
                return None
        new_ops[r] = parts
    ops = []
    for k, o in enumerate(g.ops):
        if k in ws:
            continue
        ops.extend(new_ops.get(k, [o]))
    return if_not_worse(g, Rewrite(tuple(without_syncs_on(ops, t)), g.buffers, tuple(g.ops[k].uid for k in ws + rs)))


def _valid_over(s: MemorySlice, units, data) -> np.ndarray:
    """[units, num*width] bool: the slice's valid mask over these units (read-only). Remembered
    where it loads nothing: every plan that keeps the concat/split asks for the same masks over
    the same sample of units (a composed mask: a few hundred nodes over 2^16 elements)."""
    if s.valid is None or loads(s.valid):
        return eval_over(s.valid, units, s.num, s.width, data).astype(bool).reshape(len(units), -1)
    key = (s.valid, s.num, s.width, units_key(units))
    hit = _VALID.get(key)
    if hit is None:
        if len(_VALID) >= 512:
            _VALID.clear()
        hit = _VALID[key] = eval_over(s.valid, units, s.num, s.width).astype(bool).reshape(len(units), -1)
        hit.flags.writeable = False
    return hit


_VALID: dict = {}


EXACT_CAP = 1 << 24     # reader elements the rule confirms one by one (beyond: left alone)
CONFIRM_CHUNK = 1 << 21  # reader elements evaluated at once while confirming


_CONFIRMED: dict = {}   # the greedy driver asks again after unrelated rewrites elsewhere


def _confirmed(g: GIRGraph, r: int, chosen, units, data) -> bool:
    if data and _confirm_loads(g, r, chosen):   # an index loads constant data: the answer is not memoised
        return _confirm(g, r, chosen, units, data)
    key = (g.ops[r].inputs[0], g.ops[r].outputs[0], g.parallel, units_key(units[r]),
           tuple((g.ops[w].inputs[0].level, g.ops[w].outputs[0], units_key(units[w]), c, cond) for w, c, cond in chosen))
    if key not in _CONFIRMED:
        if len(_CONFIRMED) > 256:
            _CONFIRMED.clear()
        _CONFIRMED[key] = _confirm(g, r, chosen, units, data)
    return _CONFIRMED[key]


def _confirm_loads(g: GIRGraph, r: int, chosen) -> bool:
    """Does anything `_confirm` evaluates load data? (Without loads its answer is a function of
    the slices, conditions and units alone, whatever constants the graph holds: Swin-T's
    attention subgraphs hold some, and confirmed the same choices again plan after plan.)"""
    rop = g.ops[r]
    if any(_slice_loads(x) for x in (*rop.inputs, *rop.outputs)):
        return True
    for w, c, cond in chosen:
        if _slice_loads(g.ops[w].outputs[0]) or any(loads(e) for e in (c.u, c.i, c.j)) or \
                (cond is not None and cond is not False and loads(cond)):
            return True
    return False


def _confirm(g: GIRGraph, r: int, chosen, units, data) -> bool:
    """The choice made on a sample of reader units, checked on every unit: each writer is
    injective, writes exactly the elements its condition selects (with its coordinates, as the
    reader needs them), and every element the reader reads comes from exactly one writer.
    `chosen`: (writer position, coordinates, condition; False: the writer covered nothing)."""
    rop, P = g.ops[r], g.parallel
    p2, pb = rop.inputs[0], rop.outputs[0]
    for w, _, _ in chosen:
        wop = g.ops[w]
        if not injective_exactly(wop.outputs[0], units[w], P, data):
            return False
    r_units = np.asarray(units[r], np.int64)
    predicates = _confirm_predicates(g, r, chosen, units)
    if predicates is not None:   # the units whose elements show every case the check can meet (gir/periodic.py)
        deciding = deciding_units(r_units, predicates, p2.num, p2.width)
        r_units = r_units if deciding is None else deciding
    step = max(1, CONFIRM_CHUNK // max(1, p2.count))
    for lo in range(0, len(r_units), step):
        part = r_units[lo:lo + step]
        rvalid = eval_over(p2.valid, part, p2.num, p2.width, data).astype(bool).reshape(len(part), -1)
        bvalid = eval_over(pb.valid, part, pb.num, pb.width, data).astype(bool).reshape(len(part), -1)
        if np.any(bvalid & ~rvalid):
            return False
        total, reader = np.zeros(rvalid.shape, np.int64), {}
        for w, c, cond in chosen:
            wop = g.ops[w]
            need = composition_need(wop.inputs[0].level, wop.outputs[0].level)
            covered = evaluate_coords(wop.outputs[0], units[w], p2, part, c, P, need, data, reader)
            if covered is None:
                return False
            if cond is False:
                if covered.any():
                    return False
                continue
            sel = eval_over(cond, part, p2.num, p2.width, data).astype(bool).reshape(len(part), -1)
            if not np.array_equal(sel & rvalid, covered):
                return False
            total += covered
        if not np.array_equal(total, rvalid.astype(np.int64)):
            return False
    return True


def _confirm_predicates(g: GIRGraph, r: int, chosen, units) -> list | None:
    """Every predicate whose truth values over a reader unit's elements `_confirm` looks at (its
    masks, each writer's coordinates being inside the writer, the addresses matching, `need`,
    the conditions): what decides the confirmation for that unit. None where a writer's units
    are not one run of ids (membership in them is then no comparison)."""
    P, p2, pb = g.parallel, g.ops[r].inputs[0], g.ops[r].outputs[0]
    out = [p2.valid, pb.valid]
    for w, c, cond in chosen:
        wop = g.ops[w]
        ws, wu = wop.outputs[0], np.asarray(units[w], np.int64)
        if wu.size == 0 or int(wu[-1]) - int(wu[0]) + 1 != wu.size or not bool(np.all(np.diff(wu) == 1)):
            return None
        out += [binop("le", int(wu[0]), c.u), binop("le", c.u, int(wu[-1])), binop("le", 0, c.i), c.i.lt(ws.num),
                binop("le", 0, c.j), c.j.lt(ws.width), binop("eq", c.at(ws.index), p2.index),
                c.at(ws.valid) if ws.valid is not None else None, None if cond is False else cond]
        need = composition_need(wop.inputs[0].level, ws.level)
        if need in ("unit", "lane"):
            out.append(binop("eq", c.u, U))
        if need == "group":
            out.append(binop("eq", c.u // P.units_per_group, U // P.units_per_group))
        if need == "lane":
            out.append(binop("eq", (c.j // ws.vec) % P.lanes, (J // p2.vec) % P.lanes))
    return out


def _split_move(rop: GOp, wop: GOp, c: Coords, cond: Expr | None, uid: int, units, buffers,
                exact: bool = False) -> GOp | None:
    """The composed move for one writer; `exact`: the units were sampled, so the refitted slices
    (compact fits on a sample too) are checked against the composition on every unit, and the
    composition is kept as it is where they differ."""
    pa = wop.inputs[0]
    if any(_slice_loads(x) for x in (pa, *rop.inputs, *rop.outputs)) or (cond is not None and loads(cond)) \
            or (rop.guard is not None and loads(rop.guard)):
        return _split_move_now(rop, wop, c, cond, uid, units, buffers, exact)   # depends on data: not memoised
    # every plan that keeps the concat/split composes the same moves again (Swin-T: 882 calls,
    # 334 distinct); the result but for its uid is a function of these
    key = (rop.args, rop.inputs, rop.outputs, rop.guard, rop.origin, pa, c, cond, units_key(units), exact)
    hit = _SPLIT_MOVES.get(key, _NONE)
    if hit is _NONE:
        if len(_SPLIT_MOVES) >= 1024:
            _SPLIT_MOVES.clear()
        hit = _SPLIT_MOVES[key] = _split_move_now(rop, wop, c, cond, 0, units, buffers, exact)
    return None if hit is None else replace(hit, uid=uid)


_SPLIT_MOVES: dict = {}
_NONE = object()


def _slice_loads(s: MemorySlice) -> bool:
    return bool(loads(s.index)) or (s.valid is not None and bool(loads(s.valid)))


def _split_move_now(rop: GOp, wop: GOp, c: Coords, cond: Expr | None, uid: int, units, buffers,
                    exact: bool = False) -> GOp | None:
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
    raw_src = MemorySlice(pa.buffer, pa.level, c.at(pa.index), p2.num, p2.width, pa.dtype, p2.vec,
                          _and(va, p2.valid, mask), fill)
    raw = GOp(rop.args, (raw_src,), (replace(pb, valid=_and(pb.valid, mask)),), guard, rop.origin, uid)
    src, dst = compact(raw_src, units, buffers), raw.outputs[0]
    if mask is not None:   # the written elements' condition, refitted as the source's is
        dst = compact(dst, units, buffers)
    src, dst, new_guard = _unit_conditions_to_guard(src, dst, guard)
    op = GOp(rop.args, (src,), (dst,), new_guard, rop.origin, uid)
    if exact and not _same_elements(op, raw, units, buffers):
        op = raw
    return op if register_layout_ok(op.inputs[0]) else None


_SAME: dict = {}   # (move, move, units) -> bool: the driver composes the same moves again after other rewrites


def _same_elements(a: GOp, b: GOp, units, buffers) -> bool:
    if any(loads(x.index) or (x.valid is not None and loads(x.valid)) for x in a.inputs + b.inputs):
        return _same_elements_now(a, b, units, buffers)   # depends on constant data: not memoised
    key = (a.inputs, a.outputs, a.guard, b.inputs, b.outputs, b.guard, units_key(units))
    if key not in _SAME:
        if len(_SAME) > 256:
            _SAME.clear()
        _SAME[key] = _same_elements_now(a, b, units, buffers)
    return _SAME[key]


def _same_elements_now(a: GOp, b: GOp, units, buffers) -> bool:
    """Do two moves read and write the same addresses at the same elements of every unit?
    (in chunks of units; each move's expressions share one memo of subexpression values, as a
    raw composition's index and masks repeat the same subtrees)"""
    units = np.asarray(units, np.int64)
    s = a.inputs[0]
    step = max(1, CONFIRM_CHUNK // max(1, s.count))
    pairs = [(x, y) for x, y in zip(a.inputs + a.outputs, b.inputs + b.outputs)]
    # the units whose elements show every case the comparison can meet (gir/periodic.py)
    deciding = deciding_units(units, [a.guard, b.guard] + [e for x, y in pairs for e in (
        x.valid, y.valid, binop("eq", x.index, y.index))], s.num, s.width)
    units = units if deciding is None else deciding
    for lo in range(0, len(units), step):
        part = units[lo:lo + step]
        env, shape = grid(part, s.num, s.width), (len(part), s.num, s.width)
        memo_a, memo_b = {}, {}

        def value(e, memo, dtype=np.int64):
            return np.broadcast_to(evaluate(e, env, buffers, memo), shape).astype(dtype) if e is not None \
                else np.ones(shape, dtype)
        ga, gb = value(a.guard, memo_a, bool), value(b.guard, memo_b, bool)
        for x, y in pairs:
            ma = ga & value(x.valid, memo_a, bool)
            mb = gb & value(y.valid, memo_b, bool)
            if not np.array_equal(ma, mb):
                return False
            if x.index != y.index and np.any((value(x.index, memo_a) != value(y.index, memo_b)) & ma):
                return False
    return True


def _unit_conditions_to_guard(src: MemorySlice, dst: MemorySlice, guard: Expr | None):
    """Conditions on the unit alone that both slices' masks carry become the guard's: the unit
    skips the move instead of testing every element (the same elements are read and written)."""
    if src.valid is None or dst.valid is None:
        return src, dst, guard
    theirs = conjuncts(dst.valid)
    common = [c for c in dict.fromkeys(conjuncts(src.valid)) if variables(c) <= {"u"} and c in theirs]
    if not common:
        return src, dst, guard
    rest = lambda e: _and(*(c for c in conjuncts(e) if c not in common))   # noqa: E731
    return replace(src, valid=rest(src.valid)), replace(dst, valid=rest(dst.valid)), _and(guard, *common)

