"""Merge rules: remove redundant data movement (read-after-write and read-after-read).

Register and shared data do not survive a kernel boundary, so a rule that makes a later op
read such data directly checks that no DEVICE sync (other than one that only guards the
buffer being bypassed, which then goes) separates the two.
"""
from __future__ import annotations

from dataclasses import replace

from powerfusion.gir.expr import binop
from powerfusion.gir.ir import Buffer, GIRGraph, Level, MemorySlice
from powerfusion.rewrite.base import (Rewrite, in_lane_pattern, matches, if_not_worse, active_units, consts, device_barrier_between, fresh_name, index, interface, is_move, is_sync, loaded_anywhere,
                                      next_uid, readers, register_layout_ok, rename_buffer, without_syncs_on, same_guard, written_between, writers)
from powerfusion.rewrite.merge_split import compose_split
from powerfusion.rewrite.patterns import compact, composition_need, writer_coords

def _sole_writer_move(g: GIRGraph, name: str, before: int) -> int | None:
    ws = writers(g, name)
    if len(ws) == 1 and ws[0] < before and is_move(g.ops[ws[0]]):
        return ws[0]
    return None


def _last_use(g: GIRGraph, name: str, default: int) -> int:
    return max(readers(g, name), default=default)


def _checked(g: GIRGraph, ops, changed) -> Rewrite | None:
    """A rewrite, unless it would raise modelled traffic."""
    return if_not_worse(g, Rewrite(tuple(ops), g.buffers, tuple(changed)))


def _rename_after(ops, start: int, old: str, new: str):
    return [rename_buffer(op, old, new) if k > start else op for k, op in enumerate(ops)]


@matches("move")
def compose_moves(g: GIRGraph, at: int) -> Rewrite | None:
    """move(a -> t) ; move(t -> b) => move(a -> b), through the composed index map;
    the first move stays only when t is an output or read elsewhere."""
    op2 = g.ops[at]
    if not is_move(op2):
        return None
    p2 = op2.inputs[0]
    t = p2.buffer
    if t in g.inputs or t in dict(g.constants) or loaded_anywhere(g, t):
        return None
    w = _sole_writer_move(g, t, at)
    if w is None:
        return None
    op1 = g.ops[w]
    pa, p1 = op1.inputs[0], op1.outputs[0]
    a = pa.buffer
    if a == t or a == op2.outputs[0].buffer or written_between(g, a, w, at):
        return None
    keep = t in g.outputs or readers(g, t) != [at]
    pb = op2.outputs[0]
    # a -> t -> b converts twice; one conversion a -> b gives the same numbers when a -> t is
    # exact (t widens a) or t -> b is (same dtype). Otherwise t rounds: keep that rounding in a
    # register buffer laid out like b, so a narrower staging buffer in shared or global memory
    # (bf16 between two fp32 register tiles) still goes.
    round_in = None
    if not _exact_through(g.buffer(a).dtype, g.buffer(t).dtype, g.buffer(pb.buffer).dtype):
        if keep or p1.level == Level.REGISTER or pb.level != Level.REGISTER:
            return None
        round_in = Buffer(fresh_name(g, f"{t}_rounded"), Level.REGISTER, g.buffer(pb.buffer).size, g.buffer(t).dtype)
    # register/shared data does not cross a kernel boundary; t's own syncs go only with t
    if pa.level != Level.GLOBAL and device_barrier_between(g, w, at, frozenset() if keep else frozenset({t})):
        return None
    if pa.level != Level.REGISTER and (in_lane_pattern(p2) or in_lane_pattern(pb)):
        # t -> b rearranges registers inside each lane (a window built from vector chunks that
        # were loaded once: templates/ops_strip.py): composed, every tap would load again, and a
        # load cannot write registers outside the identity layout
        return None
    u1, u2 = active_units(g, op1), active_units(g, op2)
    if u1 is None or u2 is None:
        return None
    c = writer_coords(p1, u1, p2, u2, g.parallel, composition_need(pa.level, p1.level), consts(g))
    if c is None:
        return None
    va = c.at(pa.valid) if pa.valid is not None else None
    if va is not None and p2.valid is not None:
        if pa.fill != p2.fill:
            return None
        valid, fill = binop("and", va, p2.valid), pa.fill
    else:
        valid, fill = (va, pa.fill) if va is not None else (p2.valid, p2.fill)
    src = compact(MemorySlice(a, pa.level, c.at(pa.index), p2.num, p2.width, pa.dtype, p2.vec, valid, fill), u2, consts(g))
    if not register_layout_ok(src):
        return None
    if keep and pa.level > p2.level:
        return None
    ops = list(g.ops)
    if round_in is None:
        ops[at] = replace(op2, inputs=(src,), uid=next_uid(g))
    else:
        mid = replace(pb, buffer=round_in.name, dtype=round_in.dtype)
        ops[at:at + 1] = [replace(op2, inputs=(src,), outputs=(mid,), uid=next_uid(g)),
                          replace(op2, inputs=(mid,), uid=next_uid(g) + 1)]
    changed = [op2.uid]
    if not keep:
        del ops[w]
        changed.append(op1.uid)
        ops = without_syncs_on(ops, t)
    if round_in is None:
        return _checked(g, ops, changed)
    return if_not_worse(g, Rewrite(tuple(ops), g.buffers + (round_in,), tuple(changed)))


# conversions that lose nothing: every value of the first dtype is one of the second
_WIDENS = {("float16", "float32"), ("bfloat16", "float32"), ("float16", "float64"), ("bfloat16", "float64"),
           ("float32", "float64"), ("int8", "int16"), ("int8", "int32"), ("int8", "int64"), ("int16", "int32"),
           ("int16", "int64"), ("int32", "int64"), ("uint8", "int16"), ("uint8", "int32"), ("uint8", "int64"),
           ("uint8", "uint16"), ("uint8", "uint32"), ("uint8", "uint64"), ("uint16", "int32"), ("uint16", "int64"),
           ("uint16", "uint32"), ("uint16", "uint64"), ("uint32", "int64"), ("uint32", "uint64"),
           ("int8", "float32"), ("uint8", "float32"), ("int16", "float32"), ("uint16", "float32"),
           ("int8", "float16"), ("uint8", "float16"), ("int8", "bfloat16"), ("uint8", "bfloat16")}


def _exact_through(a: str, t: str, b: str) -> bool:
    """Is converting a -> t -> b the same as a -> b?"""
    return a == t or t == b or (a, t) in _WIDENS


def _renameable(g: GIRGraph, old: str, new: str, start: int, at: int, ignore: frozenset[str] = frozenset()) -> bool:
    """Can readers of `old` after `at` read `new` instead (new unchanged meanwhile, no kernel boundary)?"""
    if old in interface(g) or loaded_anywhere(g, old) or writers(g, old) != [at]:
        return False
    if any(r < at for r in readers(g, old)):
        return False
    last = _last_use(g, old, at)
    if written_between(g, new, start, last + 1):
        return False
    return g.buffer(new).level == Level.GLOBAL or not device_barrier_between(g, start, last + 1, ignore)


@matches("move")
def cancel_moves(g: GIRGraph, at: int) -> Rewrite | None:
    """move(a -> t) ; move(t -> b) => nothing, when t is read as written and b as a is:
    later ops read a for b."""
    op2 = g.ops[at]
    if not is_move(op2):
        return None
    p2, pb = op2.inputs[0], op2.outputs[0]
    t, b = p2.buffer, pb.buffer
    w = _sole_writer_move(g, t, at)
    if w is None or t in interface(g) or loaded_anywhere(g, t) or readers(g, t) != [at]:
        return None
    op1 = g.ops[w]
    pa, p1 = op1.inputs[0], op1.outputs[0]
    a = pa.buffer
    if not same_guard(op1, op2) or p1.pattern() != p2.pattern() or pa.pattern() != pb.pattern():
        return None
    if any(s.valid is not None for s in (pa, p1, p2, pb)) or a == b:
        return None
    dts = {g.buffer(x).dtype for x in (a, t, b)}
    if len(dts) != 1 or pa.level != pb.level or written_between(g, a, w, at):
        return None
    if not _renameable(g, b, a, w, at, frozenset({t})):
        return None
    ops = _rename_after(g.ops, at, b, a)
    del ops[at]
    del ops[w]
    return Rewrite(tuple(without_syncs_on(ops, t)), g.buffers, (op1.uid, op2.uid))


@matches("move")
def drop_identity_move(g: GIRGraph, at: int) -> Rewrite | None:
    """move(a -> b), same level, pattern and type => nothing: later ops read a for b."""
    op = g.ops[at]
    if not is_move(op):
        return None
    pa, pb = op.inputs[0], op.outputs[0]
    if pa.buffer == pb.buffer or pa.level != pb.level or pa.pattern() != pb.pattern():
        return None
    if pa.valid is not None or g.buffer(pa.buffer).dtype != g.buffer(pb.buffer).dtype:
        return None
    if not _renameable(g, pb.buffer, pa.buffer, at, at):
        return None
    ops = _rename_after(g.ops, at, pb.buffer, pa.buffer)
    del ops[at]
    return Rewrite(tuple(ops), g.buffers, (op.uid,))


@matches("move")
def merge_parallel_moves(g: GIRGraph, at: int) -> Rewrite | None:
    """move(a -> b1) ‖ move(a -> b2) => move(a -> b1): the second reads b1 (or vanishes)."""
    op2 = g.ops[at]
    if not is_move(op2):
        return None
    s = op2.inputs[0]
    for w in index(g).moves_reading.get(s.buffer, []):
        op1 = g.ops[w]
        if w >= at or op1.inputs[0] != s or not same_guard(op1, op2):
            continue
        if written_between(g, s.buffer, w, at):
            continue
        b1, b2 = op1.outputs[0], op2.outputs[0]
        if writers(g, b1.buffer) != [w] or b1.buffer == b2.buffer:
            continue
        if (b1.pattern() == b2.pattern() and b1.level == b2.level
                and g.buffer(b1.buffer).dtype == g.buffer(b2.buffer).dtype and _renameable(g, b2.buffer, b1.buffer, w, at)):
            ops = _rename_after(g.ops, at, b2.buffer, b1.buffer)
            del ops[at]
            return Rewrite(tuple(ops), g.buffers, (op2.uid,))
        if (b1.level < s.level and b1.valid is None and g.buffer(b1.buffer).dtype == g.buffer(s.buffer).dtype
                and (b1.level == Level.GLOBAL or not device_barrier_between(g, w, at))):
            ops = list(g.ops)
            ops[at] = replace(op2, inputs=(b1,), uid=next_uid(g))
            return _checked(g, ops, (op2.uid,))
    return None


@matches("elementwise", "reduce", "broadcast", "move")
def drop_dead_op(g: GIRGraph, at: int) -> Rewrite | None:
    """op(-> x) => nothing, when nothing after it reads x and x is no output."""
    op = g.ops[at]
    if is_sync(op) or not op.outputs:
        return None
    for s in op.outputs:
        if s.buffer in interface(g) or loaded_anywhere(g, s.buffer) or any(r > at for r in readers(g, s.buffer)):
            return None
    return Rewrite(g.ops[:at] + g.ops[at + 1:], g.buffers, (op.uid,))


MERGE_RULES = {
    "move ; move => nothing": cancel_moves,
    "move ; move => move": compose_moves,
    "(move ‖ move) ; (move ‖ move) => move ‖ move": compose_split,
    "move(a -> a') => nothing": drop_identity_move,
    "move(a) ‖ move(a) => move(a)": merge_parallel_moves,
    "op(unread) => nothing": drop_dead_op,
}
