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

from powerfusion.gir.expr import BinOp, Const, Expr, Select, variables
from powerfusion.gir.ir import MemorySlice

DIVMOD_OPS = 4        # x / c or x % c by a constant: mul.hi + shift (+ mul + sub for %), sm_90 SASS
ELEMENT_VARS = frozenset({"i", "j"})


def slice_index_ops(s: MemorySlice, vec: int) -> float:
    """Integer instructions per element of `s` for its address (per access of `vec` elements)
    and its valid mask (per element)."""
    index = _element_ops(s.index)
    mask = _element_ops(s.valid) if s.valid is not None else 0
    return index / max(1, vec) + mask


@lru_cache(maxsize=65536)
def _element_ops(e: Expr) -> int:
    """Instructions of the distinct subexpressions of `e` that depend on i or j."""
    return _walk(e, set())


def _walk(e: Expr, seen: set) -> int:
    if not isinstance(e, (BinOp, Select)) or id(e) in seen:
        return 0
    seen.add(id(e))
    if not (variables(e) & ELEMENT_VARS):
        return 0        # the unit's part: hoisted out of the element loop
    if isinstance(e, Select):
        return 1 + _walk(e.cond, seen) + _walk(e.a, seen) + _walk(e.b, seen)
    own = _op_cost(e)
    return own + _walk(e.a, seen) + _walk(e.b, seen)


def _op_cost(e: BinOp) -> int:
    if e.op in ("floordiv", "mod"):
        power_of_two = isinstance(e.b, Const) and e.b.value > 0 and e.b.value & (e.b.value - 1) == 0
        return 1 if power_of_two else DIVMOD_OPS    # a shift or a mask, else multiply-high and shift
    return 1   # add, mul by a constant, compare, and: one integer instruction
