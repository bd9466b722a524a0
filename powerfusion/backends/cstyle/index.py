"""C source of index expressions with cheap division: GIR's // and % floor, C's truncate, so a
divisor's general form needs a correction (`pf_floordiv` / `pf_mod`: a second remainder and a
compare). Where the dividend is provably non-negative the two agree, and the division is
emitted on the unsigned index type: a constant divisor then compiles to one multiply-high and
a shift (a power of two to a shift or a mask), with no sign fix-up.

Non-negativity is decided by interval arithmetic (`gir/simplify.py`'s ranges) from the lower
bounds alone: the unit id u, and the loop variables i, j and ri, are never negative in the
emitted code (u = blockIdx.x * units_per_group + threadIdx.x / lanes; every loop counts up
from 0), whatever their upper bounds. Loads (gather indices) and other variables are opaque,
so an offset that may go negative keeps the floored form."""
from __future__ import annotations

import math
from typing import Callable

from powerfusion.gir.expr import BinOp, Const, Expr, Load, Select, Var, loads, render_c
from powerfusion.gir.simplify import _Simplifier

NONNEGATIVE_VARS = ("u", "i", "j", "ri")


def nonneg_ranges() -> _Simplifier:
    """A range oracle knowing only that the index variables are >= 0."""
    return _Simplifier({Var(v): (0, math.inf) for v in NONNEGATIVE_VARS})


def render_index(e: Expr, names, load: Callable[[str, str], str], floor: Callable[[str, str, str], str],
                 ranges: _Simplifier | None = None, checked: Callable[[Expr, int], str] | None = None) -> str:
    """`render_c(e, names, load, floor)`, except that // and % by a positive constant of a
    dividend that cannot be negative render as unsigned C division, and, with `checked`, a
    gathered index (`gathered_index`) renders as `checked(index, n)`."""
    ranges = ranges or nonneg_ranges()
    return render_c(_mark(e, names, load, floor, ranges, checked), names, load, floor)


def gathered_index(e: Expr) -> tuple[Expr, int] | None:
    """(x, n) where `e` is a gathered index as the templates build it (templates/common.py
    wrap_clamp: min(max(x < 0 ? x + n : x, 0), n - 1)) of an x that loads from a buffer."""
    if not (isinstance(e, BinOp) and e.op == "min" and isinstance(e.b, Const)):
        return None
    m = e.a
    if not (isinstance(m, BinOp) and m.op == "max" and m.b == Const(0) and isinstance(m.a, Select)):
        return None
    sel, n = m.a, e.b.value + 1
    x = sel.b
    if sel.cond != BinOp("lt", x, Const(0)) or sel.a != BinOp("add", x, Const(n)) or not loads(x):
        return None
    return x, n


class _Text(Expr):
    """An already rendered C fragment (render_c splices objects with a `text`)."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _mark(e: Expr, names, load, floor, ranges: _Simplifier, checked=None) -> Expr:
    def mark(x):
        return _mark(x, names, load, floor, ranges, checked)
    if isinstance(e, BinOp):
        if checked is not None and (g := gathered_index(e)) is not None:
            return _Text(checked(g[0], g[1]))
        if (e.op in ("floordiv", "mod") and isinstance(e.b, Const) and e.b.value > 0
                and ranges.range(e.a)[0] >= 0):
            a = render_c(mark(e.a), names, load, floor)
            sym = "/" if e.op == "floordiv" else "%"
            return _Text(f"((idx_t)((uidx_t)({a}) {sym} {e.b.value}u))")
        a, b = mark(e.a), mark(e.b)
        return e if (a is e.a and b is e.b) else BinOp(e.op, a, b)
    if isinstance(e, Select):
        c, a, b = (mark(x) for x in (e.cond, e.a, e.b))
        return e if (c is e.cond and a is e.a and b is e.b) else Select(c, a, b)
    if isinstance(e, Load):
        idx = mark(e.index)
        return e if idx is e.index else Load(e.buffer, idx)
    return e
