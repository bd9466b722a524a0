"""Swap rules: an elementwise gOperator moves forward (later) past data movement and some reduces.

Only forward, so the greedy loop terminates (driver.py). Each rule needs a unary
elementwise whose input and output slices have one pattern (so y[a] = f(x[a]) at every
address it touches) and whose result has exactly one reader; the data then travels as x
and f is applied where the reader put it. Moving an elementwise past a broadcast is not
a rule here: it would apply f to every broadcast copy, raising modelled register traffic.
"""
from __future__ import annotations

from dataclasses import replace

from powerfusion.gir.ir import Buffer, Elementwise, GIRGraph, Level, MemorySlice, Reduce
from powerfusion.rewrite.base import (Rewrite, matches, if_not_worse, fresh_name, interface, is_move, is_sync, loaded_anywhere, next_uid,
                                      readers, same_guard, written_between, writers)
from powerfusion.rewrite.merge_rules import device_barrier_between

# non-decreasing scalar functions: f(max(x)) = max(f(x)) and f(min(x)) = min(f(x))
MONOTONE = frozenset({"relu", "exp", "sigmoid", "tanh", "erf", "identity", "clip", "leaky_relu"})


def _unary_ew(g: GIRGraph, k: int):
    """(op, x slice, y slice, reader index) for a pointwise unary elementwise with one reader."""
    op = g.ops[k]
    if not isinstance(op.args, Elementwise) or len(op.inputs) != 1:
        return None
    x, y = op.inputs[0], op.outputs[0]
    if x.level != Level.REGISTER or y.level != Level.REGISTER or x.pattern() != y.pattern():
        return None
    if x.valid is not None or y.buffer in interface(g) or loaded_anywhere(g, y.buffer):
        return None
    if writers(g, y.buffer) != [k] or x.buffer == y.buffer:
        return None
    rs = readers(g, y.buffer)
    if len(rs) != 1 or rs[0] <= k or not same_guard(op, g.ops[rs[0]]):
        return None
    m = rs[0]
    if written_between(g, x.buffer, k, m + 1) or device_barrier_between(g, k, m):
        return None
    return op, x, y, m


def _reg(g: GIRGraph, base: str, like: Buffer, dtype: str, taken: list[Buffer]) -> Buffer:
    name = fresh_name(replace(g, buffers=g.buffers + tuple(taken)), base)
    return Buffer(name, like.level, like.size, dtype)


def _on(s: MemorySlice, buf: Buffer) -> MemorySlice:
    return replace(s, buffer=buf.name, level=buf.level, dtype=buf.dtype)


def _finish(g: GIRGraph, ops, new_bufs, changed) -> Rewrite | None:
    return if_not_worse(g, Rewrite(tuple(ops), g.buffers + tuple(new_bufs), tuple(changed)))


def _dtypes_equal(g: GIRGraph, *names: str) -> bool:
    return len({g.buffer(n).dtype for n in names}) == 1


@matches("elementwise")
def swap_ew_move(g: GIRGraph, at: int) -> Rewrite | None:
    """elementwise(x -> y) ; move(y -> z) => move(x -> z') ; elementwise(z' -> z), registers."""
    hit = _unary_ew(g, at)
    if hit is None:
        return None
    e, x, y, m = hit
    mv = g.ops[m]
    if not is_move(mv) or mv.outputs[0].level != Level.REGISTER or mv.inputs[0].valid is not None:
        return None
    pz = mv.outputs[0]
    if not _dtypes_equal(g, y.buffer, pz.buffer):
        return None
    xb = g.buffer(x.buffer)
    zp = _reg(g, f"{pz.buffer}_pre", g.buffer(pz.buffer), xb.dtype, [])
    uid = next_uid(g)
    new_mv = replace(mv, inputs=(_on(mv.inputs[0], xb),), outputs=(_on(pz, zp),), uid=uid)
    new_e = replace(e, inputs=(_on(pz, zp),), outputs=(pz,), guard=mv.guard, uid=uid + 1)
    ops = list(g.ops)
    ops[m:m + 1] = [new_mv, new_e]
    del ops[at]
    return _finish(g, ops, [zp], (e.uid, mv.uid))


@matches("elementwise")
def swap_ew_through_memory(g: GIRGraph, at: int) -> Rewrite | None:
    """elementwise(x -> y) ; move(y -> t) ; sync ; move(t -> z)
    => move(x -> t') ; sync ; move(t' -> z') ; elementwise(z' -> z), t in shared or global memory."""
    hit = _unary_ew(g, at)
    if hit is None:
        return None
    e, x, y, m1 = hit
    st = g.ops[m1]
    if not is_move(st) or st.outputs[0].level == Level.REGISTER or st.inputs[0].valid is not None:
        return None
    t = st.outputs[0].buffer
    if t in interface(g) or loaded_anywhere(g, t) or writers(g, t) != [m1]:
        return None
    rs = readers(g, t)
    if len(rs) != 1 or rs[0] <= m1 or not is_move(g.ops[rs[0]]):
        return None
    m2 = rs[0]
    ld = g.ops[m2]
    pz = ld.outputs[0]
    if pz.level != Level.REGISTER or ld.inputs[0].valid is not None or not _dtypes_equal(g, y.buffer, t, pz.buffer):
        return None
    xb, tb = g.buffer(x.buffer), g.buffer(t)
    tp = _reg(g, f"{t}_pre", tb, xb.dtype, [])
    zp = _reg(g, f"{pz.buffer}_pre", g.buffer(pz.buffer), xb.dtype, [tp])
    uid = next_uid(g)
    ops = list(g.ops)
    for k, op in enumerate(g.ops):   # syncs guarding t now guard t'
        if is_sync(op) and any(s.buffer == t for s in op.inputs + op.outputs):
            fix = lambda s: _on(s, tp) if s.buffer == t else s
            ops[k] = replace(op, inputs=tuple(map(fix, op.inputs)), outputs=tuple(map(fix, op.outputs)))
    ops[m1] = replace(st, inputs=(_on(st.inputs[0], xb),), outputs=(_on(st.outputs[0], tp),), uid=uid)
    ops[m2:m2 + 1] = [replace(ld, inputs=(_on(ld.inputs[0], tp),), outputs=(_on(pz, zp),), uid=uid + 1),
                      replace(e, inputs=(_on(pz, zp),), outputs=(pz,), guard=ld.guard, uid=uid + 2)]
    del ops[at]
    return _finish(g, ops, [tp, zp], (e.uid, st.uid, ld.uid))


@matches("elementwise")
def swap_ew_reduce(g: GIRGraph, at: int) -> Rewrite | None:
    """elementwise(f, x -> y) ; reduce(max|min, y -> r) => reduce(x -> r') ; elementwise(f, r' -> r),
    f non-decreasing (it commutes with max and min)."""
    hit = _unary_ew(g, at)
    if hit is None:
        return None
    e, x, y, m = hit
    red = g.ops[m]
    if not isinstance(red.args, Reduce) or red.args.fn not in ("max", "min") or e.args.fn not in MONOTONE:
        return None
    params = dict(e.args.params)
    if e.args.fn == "leaky_relu" and float(params.get("alpha", 0.0)) < 0:
        return None
    pr = red.outputs[0]
    if red.inputs[0].valid is not None or pr.level != Level.REGISTER or not _dtypes_equal(g, x.buffer, y.buffer, pr.buffer):
        return None
    xb = g.buffer(x.buffer)
    rp = _reg(g, f"{pr.buffer}_pre", g.buffer(pr.buffer), xb.dtype, [])
    uid = next_uid(g)
    ops = list(g.ops)
    ops[m:m + 1] = [replace(red, inputs=(_on(red.inputs[0], xb),), outputs=(_on(pr, rp),), uid=uid),
                    replace(e, inputs=(_on(pr, rp),), outputs=(pr,), guard=red.guard, uid=uid + 1)]
    del ops[at]
    return _finish(g, ops, [rp], (e.uid, red.uid))


SWAP_RULES = {
    "elementwise ; move => move ; elementwise": swap_ew_move,
    "elementwise ; move ; sync ; move => move ; sync ; move ; elementwise": swap_ew_through_memory,
    "elementwise ; reduce(max|min) => reduce(max|min) ; elementwise": swap_ew_reduce,
}
