"""How a GIR slice maps onto BANG C copies: flat runs, strided rows, or element loops.

A slice is *flat* when it is one contiguous run of `count` elements (index
`start(u) + i*width + j`), *row-contiguous* when each segment i is a contiguous run
(coefficient 1 in j, or width 1). Flat and row-contiguous slices become `__memcpy`s
(the 2-D strided form when the segment stride is a constant at least the width);
anything else (transposes through // and %, masks, gathers) is an element loop.
"""
from __future__ import annotations

from powerfusion.gir.expr import Const, Expr, affine_coefficient, render_c, substitute
from powerfusion.gir.ir import Level, MemorySlice

SPACE = {Level.REGISTER: "NRAM", Level.SHARED: "SRAM", Level.GLOBAL: "GDRAM"}


def direction(src: Level, dst: Level) -> str:
    return f"{SPACE[src]}2{SPACE[dst]}"


def flat_start(s: MemorySlice) -> Expr | None:
    """start(u) when s is one contiguous run start .. start+count, else None."""
    cj = affine_coefficient(s.index, "j") if s.width > 1 else 1
    ci = affine_coefficient(s.index, "i") if s.num > 1 else s.width
    if cj != 1 or ci != s.width:
        return None
    return substitute(s.index, {"i": Const(0), "j": Const(0)})


def row_start(s: MemorySlice) -> Expr | None:
    """start(u, i) of segment i when every segment is contiguous, else None."""
    cj = affine_coefficient(s.index, "j") if s.width > 1 else 1
    if cj != 1:
        return None
    return substitute(s.index, {"j": Const(0)})


def row_stride(s: MemorySlice) -> int | None:
    """Constant distance between segments (elements), else None."""
    c = affine_coefficient(s.index, "i")
    return c if isinstance(c, int) else None


def const_value(e: Expr | None) -> int | None:
    return e.value if isinstance(e, Const) else None


class Raw(Expr):
    """A C fragment spliced into an index expression (renderer-internal only)."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


def c_index(e: Expr, uvar: str, ivar: str = "i", jvar: str = "j", load=None) -> str:
    return render_c(e, {"u": uvar, "i": ivar, "j": jvar}, load=load)
