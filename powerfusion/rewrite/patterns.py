"""Slice-pattern algebra for the rules: which writer element a reader element reads.

A writer slice `w` (unit u1, position i1, j1 -> address w(u1, i1, j1)) and a reader
slice `r` of the same buffer. `writer_coords` finds index expressions (u1, i1, j1) over the
reader's (u, i, j) with w(u1, i1, j1) = r(u, i, j): from equal patterns directly, else by
mixed-radix decomposition of the address when `w` is affine (in i and j, and in u unless the
reader is known to be the writing unit). Every candidate is then checked exactly by
evaluation over all active units (shapes are static), so a rule built on it never changes
what any element holds: when the check fails the rule does not fire.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerfusion.gir.expr import Const, Expr, I, J, U, Var, affine_coefficient, evaluate, loads, substitute
from powerfusion.gir.ir import MemorySlice, Parallel

_ADDR = Var("addr")


@dataclass(frozen=True, slots=True)
class Coords:
    """Writer coordinates as expressions over the reader's u, i, j."""
    u: Expr
    i: Expr
    j: Expr

    def at(self, e: Expr) -> Expr:
        """`e` (over the writer's u, i, j) seen from the reader."""
        return substitute(e, {"u": self.u, "i": self.i, "j": self.j})


def _decompose(rel: Expr, terms: list[tuple[int, int, str]]) -> dict[str, Expr] | None:
    """Solve rel = sum(c * v) for v < extent, given non-overlapping nested coefficients."""
    terms = sorted((t for t in terms if t[1] > 1), key=lambda t: t[0])
    out: dict[str, Expr] = {}
    for k, (c, ext, name) in enumerate(terms):
        if c <= 0:
            return None
        if k + 1 < len(terms):
            nxt = terms[k + 1][0]
            if nxt < c * ext:
                return None   # overlapping ranges: the address does not determine the coordinates
            out[name] = (rel % nxt) // c
        else:
            out[name] = rel // c
    return out


def _candidates(w: MemorySlice, parallel: Parallel, same_unit: bool):
    """Inverse maps address -> writer (u1, i1, j1), as expressions over `addr` and the reader's u."""
    if loads(w.index):
        return
    ci, cj = affine_coefficient(w.index, "i"), affine_coefficient(w.index, "j")
    if ci is None or cj is None:
        return
    ij = [(ci, w.num, "i"), (cj, w.width, "j")]
    if same_unit:
        base = substitute(w.index, {"i": Const(0), "j": Const(0)})
        sol = _decompose(_ADDR - base, ij)
        if sol is not None:
            yield U, sol
        return
    cu = affine_coefficient(w.index, "u")
    if cu is None:
        return
    c0 = substitute(w.index, {"u": Const(0), "i": Const(0), "j": Const(0)})
    sol = _decompose(_ADDR - c0, ij + [(cu, parallel.units, "u")])
    if sol is not None:
        yield sol.get("u", Const(0)), sol


def writer_coords(w: MemorySlice, w_units: np.ndarray, r: MemorySlice, r_units: np.ndarray,
                  parallel: Parallel, need: str | None, buffers=None) -> Coords | None:
    """Coordinates of the writer element each valid reader element reads, checked exactly.

    need: None (any unit may read it), "group" (same group), "unit" (same unit) or "lane"
    (same unit and lane). The writer must write each address at most once."""
    tries = []
    if w.pattern() == r.pattern() and np.array_equal(w_units, r_units):
        tries.append(Coords(U, I, J))
    for same_unit in ((True,) if need in ("unit", "lane") else (True, False)):
        for u1, sol in _candidates(w, parallel, same_unit):
            m = {"addr": r.index}
            tries.append(Coords(substitute(u1, m), substitute(sol.get("i", Const(0)), m),
                                substitute(sol.get("j", Const(0)), m)))
    for c in tries:
        if _check(w, w_units, r, r_units, c, parallel, need, buffers):
            return c
    return None


def _grid(units, num, width):
    return {"u": np.asarray(units, np.int64)[:, None, None], "i": np.arange(num)[None, :, None],
            "j": np.arange(width)[None, None, :]}


def _full(x, shape):
    return np.broadcast_to(np.asarray(x, dtype=np.int64), shape)


def _check(w, w_units, r, r_units, c: Coords, parallel, need, buffers) -> bool:
    if len(r_units) == 0:
        return True
    shape = (len(r_units), r.num, r.width)
    env = _grid(r_units, r.num, r.width)
    try:
        addr = _full(evaluate(r.index, env, buffers), shape)
        rmask = _full(evaluate(r.valid, env, buffers), shape).astype(bool) if r.valid is not None else np.ones(shape, bool)
        u1, i1, j1 = (_full(evaluate(e, env, buffers), shape) for e in (c.u, c.i, c.j))
        inside = np.isin(u1, w_units) & (i1 >= 0) & (i1 < w.num) & (j1 >= 0) & (j1 < w.width)
        wenv = {"u": np.where(inside, u1, w_units[0] if len(w_units) else 0), "i": np.where(inside, i1, 0),
                "j": np.where(inside, j1, 0)}
        waddr = _full(evaluate(w.index, wenv, buffers), shape)
        wvalid = _full(evaluate(w.valid, wenv, buffers), shape).astype(bool) if w.valid is not None else True
        if not _injective(w, w_units, parallel, buffers):
            return False
    except KeyError:      # a gather index from runtime data: cannot be decided statically
        return False
    ok = inside & (waddr == addr) & wvalid
    if need in ("unit", "lane"):
        ok &= u1 == env["u"]
    if need == "group":
        ok &= u1 // parallel.units_per_group == env["u"] // parallel.units_per_group
    if need == "lane":
        ok &= (j1 // w.vec) % parallel.lanes == (env["j"] // r.vec) % parallel.lanes
    return bool(np.all(ok | ~rmask))


def _injective(w: MemorySlice, w_units, parallel: Parallel, buffers) -> bool:
    """No element written twice by this slice (keyed by owner group/unit below GLOBAL)."""
    addr = w.addresses(w_units, buffers)
    m = w.mask(w_units, buffers)
    u = np.asarray(w_units, np.int64)[:, None]
    owner = u // parallel.units_per_group if w.level.name == "SHARED" else u if w.level.name == "REGISTER" else 0
    vals = (addr + owner * (int(addr.max(initial=0)) + 1))[m]
    return np.unique(vals).size == vals.size
