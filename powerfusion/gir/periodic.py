"""The units that decide a check over index expressions, found exactly without evaluating every unit.

An index expression without loads (gir/expr.py: u, i, j, constants, + - *, // and % by
constants, comparisons, and/or, select, min/max) is quasi-periodic in the unit index u: each
node e has a period p and a slope s with e(u + p, i, j) = e(u, i, j) + s for every integer u,
i, j (floor division: (x + m*d) // d = x // d + m and (x + m*d) % d = x % d).

A check that asks, for every unit, something of the truth values of a few predicates over the
unit's elements (the rules' exact confirmations: "these masks agree and these addresses are
equal wherever they hold") depends on a unit only through its comparisons, the *atoms*
(a op b, that is a - b against 0; a number tested for truth is e against 0). With P the
common period and the units base + r + q*P (residue r, block q):
 * an atom whose difference has slope 0 is periodic: the same at every q;
 * an atom whose difference grows by S != 0 per block keeps one sign, for residue r, in every
   block outside lo_r + q*S <= 0 <= hi_r + q*S (lo_r, hi_r: the difference's extremes over
   residue r's elements in block 0), a bounded run of blocks.
So in a run of blocks of one residue where no atom is critical, every unit has the truth values
of the run's first block: the critical blocks plus the first block of each such run decide the
check for all units, and `deciding_units` returns them. Where the argument does not hold (a load,
a product of two u-dependent terms, a divisor that depends on u, a non-periodic comparison used
as a number, units that are not consecutive ids, a period too long to gain) it returns None and
the caller checks every unit, as before.
"""
from __future__ import annotations

from math import gcd

import numpy as np

from powerfusion.gir.expr import BinOp, Const, Expr, Select, Var, evaluate, loads, variables

_COMPARE = frozenset(("lt", "le", "eq", "ne"))
_LOGIC = frozenset(("and", "or"))
MAX_PERIOD = 1 << 20   # units; a longer common period is not worth the analysis
GAIN = 4               # the deciding units must be at most 1/GAIN of the units


class _NotPeriodic(Exception):
    """The expression falls outside the quasi-periodic fragment."""


def _lcm(a: int, b: int) -> int:
    out = a * b // gcd(a, b)
    if out > MAX_PERIOD:
        raise _NotPeriodic
    return out


def _same_slope(shapes) -> tuple[int, int]:
    """(period, slope) of a node whose value is one of its operands' (select, min, max): their
    slopes over the common period must agree."""
    p = 1
    for q, _ in shapes:
        p = _lcm(p, q)
    slopes = {s * (p // q) for q, s in shapes}
    if len(slopes) != 1:
        raise _NotPeriodic
    return p, slopes.pop()


def _combine(a, b, sign: int) -> tuple[int, int]:
    p = _lcm(a[0], b[0])
    return p, a[1] * (p // a[0]) + sign * b[1] * (p // b[0])


def _divided(inner, d: int, op: str) -> tuple[int, int]:
    """x // d or x % d for x of (period p, slope s): after k = |d| / gcd(s, d) periods x has grown
    by a multiple m of d, so x // d grows by m and x % d is back where it was."""
    p, s = inner
    k = abs(d) // gcd(abs(s), abs(d)) if s else 1
    period = p * k
    if period > MAX_PERIOD:
        raise _NotPeriodic
    return period, (s * k // d if op == "floordiv" else 0)


_SHAPES: dict = {}   # node -> (period, slope) or None: the same shared nodes are asked about again and again


def shape(e: Expr) -> tuple[int, int] | None:
    """(period, slope) in u of `e`, or None outside the quasi-periodic fragment."""
    try:
        return _shape(e)
    except _NotPeriodic:
        return None


def _shape(e: Expr) -> tuple[int, int]:
    if isinstance(e, Const):
        return 1, 0
    if isinstance(e, Var):
        return (1, 1) if e.name == "u" else (1, 0)
    hit = _SHAPES.get(e, _MISS)
    if hit is _MISS:
        try:
            hit = _node_shape(e)
        except _NotPeriodic:
            hit = None
        if len(_SHAPES) >= 1 << 16:
            _SHAPES.clear()
        _SHAPES[e] = hit
    if hit is None:
        raise _NotPeriodic
    return hit


_MISS = object()


def _node_shape(e: Expr) -> tuple[int, int]:
    if isinstance(e, Select):
        p, s = _same_slope([_shape(e.a), _shape(e.b)])
        q = _lcm(_periodic(e.cond)[0], p)
        return q, s * (q // p)
    if not isinstance(e, BinOp):   # a load: its value is data
        raise _NotPeriodic
    op = e.op
    if op in ("add", "sub"):
        return _combine(_shape(e.a), _shape(e.b), 1 if op == "add" else -1)
    if op == "mul":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(y, Const):
                p, s = _shape(x)
                return p, s * y.value
        return _lcm(_periodic(e.a)[0], _periodic(e.b)[0]), 0
    if op in ("floordiv", "mod"):
        if isinstance(e.b, Const) and e.b.value != 0:
            return _divided(_shape(e.a), e.b.value, op)
        return _lcm(_periodic(e.a)[0], _periodic(e.b)[0]), 0
    if op in ("min", "max"):
        return _same_slope([_shape(e.a), _shape(e.b)])
    if op in _COMPARE:   # used as a number: only a periodic comparison is one
        p, s = _combine(_shape(e.a), _shape(e.b), -1)
        if s:
            raise _NotPeriodic
        return p, 0
    if op in _LOGIC:
        return _lcm(_periodic(e.a)[0], _periodic(e.b)[0]), 0
    raise _NotPeriodic


def _periodic(e: Expr) -> tuple[int, int]:
    p, s = _shape(e)
    if s:
        raise _NotPeriodic
    return p, 0


def consecutive(units: np.ndarray) -> bool:
    """One run of consecutive unit ids (what the period arguments need)."""
    return units.ndim == 1 and units.size > 0 and int(units[-1]) - int(units[0]) + 1 == units.size \
        and bool(np.all(np.diff(units) == 1))


def deciding_units(units, predicates, num: int, width: int) -> np.ndarray | None:
    """The units among `units` (consecutive ids) whose elements (i < num, j < width) take every
    combination of the predicates' truth values that any unit takes, unit by unit: a check
    that depends on each unit only through those truth values holds for all units iff it holds
    for these. None: no such subset is known (check every unit). `predicates`: expressions
    tested for truth (None entries are skipped); any loads make the answer None.

    Atoms in u alone (a channel's range test (u // 56) % 96 < 64, a writer's u <= 3583) are
    evaluated at every unit, their signs taken as they are, so they need no period: only the
    atoms that mix u with i or j go through the period argument. A unit is then kept for each
    distinct (residue, run of blocks, signs of the u-only atoms); two units that agree on those
    give every atom the same truth values on every element."""
    units = np.asarray(units, np.int64)
    if num * width == 0 or not consecutive(units):
        return None
    atoms: list = []
    for e in predicates:
        if e is not None:
            _split_atoms(e, atoms)
    if any(loads(a) or loads(b) for a, b in atoms):
        return None
    names = [variables(a) | variables(b) for a, b in atoms]
    mixed = [ab for ab, v in zip(atoms, names) if "u" in v and len(v) > 1]
    alone = list(dict.fromkeys(ab for ab, v in zip(atoms, names) if v == {"u"}))
    n = units.size
    try:
        classes = _run_classes(units, mixed, num, width)
    except _NotPeriodic:
        return None
    if classes is None:
        return None
    if alone:
        env, seen = {"u": units}, {}
        signs = [np.sign(np.broadcast_to(evaluate(a, env, None, seen), (n,)).astype(np.int64)
                         - np.broadcast_to(evaluate(b, env, None, seen), (n,)).astype(np.int64)) for a, b in alone]
        key = np.stack([classes] + signs, axis=1)
        _, first = np.unique(key, axis=0, return_index=True)
    else:
        _, first = np.unique(classes, return_index=True)
    out = np.sort(units[first])
    return out if out.size * GAIN <= n else None


def _split_atoms(e: Expr, out: list) -> None:
    """The comparisons whose truth values make up `e`'s (as a predicate), as (a, b): a op b."""
    if isinstance(e, BinOp) and e.op in _LOGIC:
        _split_atoms(e.a, out)
        _split_atoms(e.b, out)
        return
    out.append((e.a, e.b) if isinstance(e, BinOp) and e.op in _COMPARE else (e, Const(0)))


def _run_classes(units: np.ndarray, mixed, num: int, width: int) -> np.ndarray | None:
    """Per unit, the id of the unit that stands for it under the atoms mixing u with i, j (the
    first unit of its run of blocks, per residue of the common period); None where the period
    is too long to gain. Raises _NotPeriodic outside the quasi-periodic fragment."""
    n = units.size
    if not mixed:
        return np.zeros(n, np.int64)
    atoms = []
    period = 1
    for a, b in mixed:
        p, s = _combine(_shape(a), _shape(b), -1)
        atoms.append((a, b, p, s))
        period = _lcm(period, p)
    if period * GAIN > n:
        return None
    blocks = -(-n // period)
    check = _blocks_to_check(int(units[0]), period, blocks, atoms, num, width)
    # each unchecked block shares its atoms' truth values with the last checked block before it
    # (of its residue): the start of its run
    rep = np.where(check, np.arange(blocks)[None, :], -1)
    rep = np.maximum.accumulate(rep, axis=1)
    pos = np.arange(n)
    r, q = pos % period, pos // period
    return r + rep[r, q] * period


def _blocks_to_check(base: int, period: int, blocks: int, atoms, num: int, width: int) -> np.ndarray:
    """[period, blocks] bool, per residue: the blocks where some atom may change sign (each
    checked) and the first block of each run where every atom keeps one sign (it stands for
    the run). An atom's sign can also flip between two neighbouring blocks without reaching 0
    in either (a - b steps over 0): that block starts a new run too."""
    critical = np.zeros((period, blocks + 1), np.int64)
    starts = np.zeros((period, blocks + 1), bool)
    starts[:, 0] = True
    moving = [(a, b, p, s) for a, b, p, s in atoms if s]
    residues = np.arange(period)
    env = {"u": (base + residues)[:, None, None], "i": np.arange(num)[None, :, None], "j": np.arange(width)[None, None, :]}
    seen: dict = {}
    shape3 = (period, num, width)
    for a, b, p, s in dict.fromkeys(moving):
        d = np.broadcast_to(evaluate(a, env, None, seen), shape3).astype(np.int64) - \
            np.broadcast_to(evaluate(b, env, None, seen), shape3).astype(np.int64)
        lo, hi = d.min(axis=(1, 2)), d.max(axis=(1, 2))
        step = s * (period // p)   # growth of a - b per block
        if step > 0:    # one sign before `first`, the other after `last`: lo + q*step <= 0 <= hi + q*step between
            first, last = -(hi // step), (-lo) // step
        else:
            t = -step
            first, last = -((-lo) // t), hi // t
        for edge in (first, last + 1):   # where the atom's sign (or criticality) changes
            inside = (edge >= 0) & (edge < blocks)
            starts[residues[inside], edge[inside]] = True
        lo_q, hi_q = np.maximum(first, 0), np.minimum(last, blocks - 1)
        hit = lo_q <= hi_q
        np.add.at(critical, (residues[hit], lo_q[hit]), 1)
        np.add.at(critical, (residues[hit], hi_q[hit] + 1), -1)
    return (np.cumsum(critical, axis=1) > 0)[:, :blocks] | starts[:, :blocks]
