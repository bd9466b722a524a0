"""A contiguous load whose vectors start off the vector grid by a constant (a window tap one
column left or right of an aligned row: involution's shifted slices, a padded image read at
-1): two aligned vector loads and a selection, instead of one scalar load per element. Loads of
neighbouring taps then share their aligned vectors (the compiler loads an address once), so the
three taps of a 3-wide window row cost three vector loads, not one vector and eight scalars.
"""
from __future__ import annotations

from powerfusion.gir.expr import BinOp, Const, Expr, const


def split_offset(index: Expr) -> tuple[Expr, int]:
    """index = rest + c, c the sum of the constants of its top-level sum (rest without them)."""
    terms: list[tuple[int, Expr]] = []

    def walk(e: Expr, sign: int) -> None:
        if isinstance(e, BinOp) and e.op in ("add", "sub"):
            walk(e.a, sign)
            walk(e.b, sign if e.op == "add" else -sign)
        else:
            terms.append((sign, e))
    walk(index, 1)
    c = sum(s * t.value for s, t in terms if isinstance(t, Const))
    rest: Expr | None = None
    for s, t in terms:
        if isinstance(t, Const):
            continue
        rest = (t if s > 0 else const(0) - t) if rest is None else (rest + t if s > 0 else rest - t)
    return (rest if rest is not None else const(0)), int(c)


def realigned(index: Expr, vec: int, size: int, aligned) -> tuple[Expr, int] | None:
    """(aligned base index, shift) with index = base + shift, 0 < shift < vec, when `aligned`
    (the renderer's test) holds for the base and the buffer is whole vectors (then both aligned
    vectors around a fully valid run lie inside it); else None."""
    rest, c = split_offset(index)
    shift = c % vec
    if not shift or size % vec or not aligned(rest, vec):
        return None
    return rest + (c - shift), shift
