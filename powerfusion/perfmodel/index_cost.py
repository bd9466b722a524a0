"""Integer instructions a lane spends on the addresses and masks of a slice (the perf model's
index-arithmetic term).

A composed move (a channel shuffle's concat -> transpose -> split) addresses its source through
chains of // and % by constants. Where such a chain depends on the element (i or j), every
element pays for it: nvcc turns `x / c` and `x % c` by an unsigned constant into a multiply-high
and a shift (plus a multiply and a subtract for the remainder). Parts that depend on the unit alone
are computed once per unit (hoisted out of the element loop) and are not counted. An index is
computed once per access of `vec` elements; a valid mask is tested per element (the vector path
tests every element's mask before it takes the vector).

Counted as distinct subexpression nodes (nvcc's common-subexpression elimination; composed
indices share their subtrees by identity): counting the tree would charge each many times.
"""
from __future__ import annotations

from functools import lru_cache

from powerfusion.gir.expr import BinOp, Const, Expr, J, Select, variables
from powerfusion.gir.ir import MemorySlice

DIVMOD_OPS = 4        # x / c or x % c by a constant: mul.hi + shift (+ mul + sub for %), sm_90 SASS
ELEMENT_VARS = frozenset({"i", "j"})


def slice_index_ops(s: MemorySlice, vec: int, lane_vec: int = 1) -> float:
    """Integer instructions per element of `s` for its address (per access of `vec` elements)
    and its valid mask (per element). Subexpressions that see j only as j // lane_vec (the
    lane's vector of a register tile lane_vec wide: a depthwise strip's row and column of the
    lane's first output) are the same for the lane's lane_vec elements: nvcc computes them
    once per vector (it knows j = 4 * lane + v, v < 4, has the lane in j // 4)."""
    lv = max(1, lane_vec)
    index = _element_ops(s.index, lv)
    mask = _element_ops(s.valid, lv) if s.valid is not None else (0, 0)
    return index[0] / max(1, vec) + index[1] / max(vec, lv) + mask[0] + mask[1] / lv


@lru_cache(maxsize=65536)
def _element_ops(e: Expr, lane_vec: int = 1) -> tuple[int, int]:
    """Instructions of the distinct subexpressions of `e` that depend on i or j: (per element,
    per lane vector -- those that see j only through j // lane_vec)."""
    out = [0, 0]
    _walk(e, set(), lane_vec, out)
    return out[0], out[1]


def _walk(e: Expr, seen: set, lane_vec: int, out: list) -> None:
    if not isinstance(e, (BinOp, Select)) or id(e) in seen:
        return
    seen.add(id(e))
    if not (variables(e) & ELEMENT_VARS):
        return          # the unit's part: hoisted out of the element loop
    coarse = lane_vec > 1 and not _fine(e, lane_vec)
    if isinstance(e, Select):
        out[coarse] += 1
        for p in (e.cond, e.a, e.b):
            _walk(p, seen, lane_vec, out)
        return
    out[coarse] += _op_cost(e)
    _walk(e.a, seen, lane_vec, out)
    _walk(e.b, seen, lane_vec, out)


def _fine(e: Expr, lane_vec: int) -> bool:
    """Does j occur in e other than as j // c with c a multiple of lane_vec? Then e may differ
    between the elements of a lane's vector."""
    if isinstance(e, BinOp):
        if e.op == "floordiv" and e.a == J and isinstance(e.b, Const) and e.b.value % lane_vec == 0:
            return False
        return _fine(e.a, lane_vec) or _fine(e.b, lane_vec)
    if isinstance(e, Select):
        return any(_fine(p, lane_vec) for p in (e.cond, e.a, e.b))
    return "j" in variables(e)


def _op_cost(e: BinOp) -> int:
    if e.op in ("floordiv", "mod"):
        power_of_two = isinstance(e.b, Const) and e.b.value > 0 and e.b.value & (e.b.value - 1) == 0
        return 1 if power_of_two else DIVMOD_OPS    # a shift or a mask, else multiply-high and shift
    return 1   # add, mul by a constant, compare, and: one integer instruction


def lane_uniform(index: Expr, lane_vec: int) -> bool:
    """Is the address the same for the lane_vec elements of a lane's vector (j only as
    j // lane_vec)? Loads of such a slice are one per vector once nvcc merges them."""
    return "j" in variables(index) and not _fine(index, lane_vec)
