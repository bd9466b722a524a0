"""How a GIR slice maps onto BANG C copies: flat runs, strided rows, or element loops.

A slice is *flat* when it is one contiguous run of `count` elements (index
`start(u) + i*width + j`), *row-contiguous* when each segment i is a contiguous run
(coefficient 1 in j, or width 1). Flat and row-contiguous slices become `__memcpy`s
(the 2-D strided form when the segment stride is a constant at least the width);
anything else (transposes through // and %, masks, gathers) is an element loop.
"""
from __future__ import annotations

from powerfusion.gir.expr import BinOp, Const, Expr, Load, Select, affine_coefficient, render_c, substitute
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
    """C for an index expression with GIR's floor // and % (render_c assumes non-negative
    operands; the rewrites produce offsets like `(x + -1024) % 9216` that go negative)."""
    names = {"u": uvar, "i": ivar, "j": jvar}

    def go(x: Expr) -> str:
        if hasattr(x, "text"):
            return x.text
        if isinstance(x, BinOp):
            a, b = go(x.a), go(x.b)
            if x.op in ("floordiv", "mod") and _may_be_negative(x.a):
                return f"pf_ifloor{'div' if x.op == 'floordiv' else 'mod'}({a}, {b})"
            if x.op in ("min", "max"):
                return f"pf_i{x.op}({a}, {b})"
            return f"({a} {_C_OPS[x.op]} {b})"
        if isinstance(x, Select):
            return f"({go(x.cond)} ? {go(x.a)} : {go(x.b)})"
        if isinstance(x, Load):
            idx = go(x.index)
            return load(x.buffer, idx) if load else f"((int){x.buffer}[{idx}])"
        return render_c(x, names)

    return go(e)


_C_OPS = {"add": "+", "sub": "-", "mul": "*", "floordiv": "/", "mod": "%", "lt": "<", "le": "<=", "eq": "==",
          "ne": "!=", "and": "&&", "or": "||"}


def _may_be_negative(e: Expr) -> bool:
    """False when e is built from u, i, j, non-negative constants and + * // % min max only."""
    if isinstance(e, Const):
        return e.value < 0
    if isinstance(e, BinOp):
        return e.op == "sub" or _may_be_negative(e.a) or _may_be_negative(e.b)
    return not (hasattr(e, "text") or e.__class__.__name__ == "Var")


def c_float(x: float) -> str:
    """A float literal that both cncc (clang) and g++ accept, NaN and infinities included."""
    import math
    if math.isnan(x):
        return "__builtin_nanf(\"\")"
    if math.isinf(x):
        return "(-__builtin_inff())" if x < 0 else "__builtin_inff()"
    return f"{float(x)!r}f"
