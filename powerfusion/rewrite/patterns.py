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

import itertools
from dataclasses import dataclass, replace

import numpy as np

from powerfusion.gir.expr import (BinOp, Const, binop, Expr, I, J, Select, U, Var, affine_coefficient, evaluate, loads,
                                  substitute, variables)
from powerfusion.gir.ir import Level, MemorySlice, Parallel, member_mask, units_key, unnamed
from powerfusion.gir.periodic import deciding_units

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


def _divisors(e: Expr) -> set[int]:
    """Constants d of u // d and u % d in an index: the digits a unit index is split into."""
    if isinstance(e, BinOp):
        out = _divisors(e.a) | _divisors(e.b)
        if e.op in ("floordiv", "mod") and isinstance(e.b, Const) and e.a == U and e.b.value > 1:
            out.add(e.b.value)
        return out
    if isinstance(e, Select):
        return _divisors(e.cond) | _divisors(e.a) | _divisors(e.b)
    return set()


def _unit_digits(w: MemorySlice, parallel: Parallel):
    """offset(u) = c0 + sum(c_k * digit_k(u)), digits of u in the mixed radix of its divisors,
    fitted on every unit and checked exactly; yields (c0, [(c_k, extent_k, place_k)])."""
    ds = sorted(_divisors(w.index))
    if any(b % a for a, b in zip(ds, ds[1:])):
        return None
    bounds = [1] + ds
    units = np.arange(parallel.units, dtype=np.int64)
    digits = [(units // lo) % (hi // lo) for lo, hi in zip(bounds, bounds[1:])] + [units // bounds[-1]]
    extents = [hi // lo for lo, hi in zip(bounds, bounds[1:])] + [-(-parallel.units // bounds[-1])]
    offset = np.broadcast_to(evaluate(substitute(w.index, {"i": Const(0), "j": Const(0)}), {"u": units}),
                             units.shape).astype(np.float64)
    A = np.stack([np.ones(len(units))] + [d.astype(np.float64) for d in digits], axis=1)
    coef = np.rint(np.linalg.lstsq(A, offset, rcond=None)[0]).astype(np.int64)
    if not np.array_equal(A.astype(np.int64) @ coef, offset.astype(np.int64)):
        return None
    return int(coef[0]), [(int(c), ext, place) for c, ext, place in zip(coef[1:], extents, bounds)]


def _extents(w: MemorySlice, w_units, buffers) -> tuple[int, int]:
    """num and width as far as the valid mask lets the writer write (a masked tail is no digit)."""
    if w.valid is None or len(w_units) == 0:
        return w.num, w.width
    w_units = np.asarray(w_units, np.int64)
    deciding = deciding_units(w_units, [w.valid], w.num, w.width)   # every unit's mask is one of theirs
    w_units = w_units if deciding is None else deciding
    try:
        m = w.mask(w_units, buffers).reshape(len(w_units), w.num, w.width)
    except KeyError:
        return w.num, w.width
    rows, cols = np.nonzero(m.any(axis=(0, 2)))[0], np.nonzero(m.any(axis=(0, 1)))[0]
    return (int(rows.max()) + 1 if rows.size else 1), (int(cols.max()) + 1 if cols.size else 1)


def _candidates(w: MemorySlice, parallel: Parallel, same_unit: bool, extents: tuple[int, int], flat: int | None = None):
    """Inverse maps address -> writer (u1, i1, j1), as expressions over `addr` and the reader's u.
    `flat`: how many leading elements of the row-major (i, j) space the writer writes, when the
    valid mask cuts it inside a segment (else None)."""
    if loads(w.index):
        return
    ci, cj = affine_coefficient(w.index, "i"), affine_coefficient(w.index, "j")
    if ci is None or cj is None:
        return
    ij = [(ci, extents[0], "i"), (cj, extents[1], "j")]
    if flat is not None and cj > 0 and ci == cj * w.width:
        # row-major segments (i * width + j) whose valid run is not a whole number of segments
        # (a 784-element row in segments of 128): one digit k, split into i and j afterwards
        ij = [(cj, flat, "k")]
    if same_unit:
        base = substitute(w.index, {"i": Const(0), "j": Const(0)})
        sol = _split_flat(_decompose(_ADDR - base, ij), w.width)
        if sol is not None:
            yield U, sol
        return
    fit = _unit_digits(w, parallel)
    if fit is None:
        return
    c0, digits = fit
    names = [f"d{k}" for k in range(len(digits))]
    # a unit digit the address ignores (several units share an address, the valid mask
    # picking one of them) is not in the address: try each of its values (the check decides)
    free = [(ext, place) for (c, ext, place) in digits if c == 0 and ext > 1]
    sol = _split_flat(_decompose(_ADDR - c0, ij + [(c, ext, n) for (c, ext, _), n in zip(digits, names)
                                                    if c != 0 or ext <= 1]), w.width)
    if sol is None or int(np.prod([ext for ext, _ in free], dtype=np.int64)) > 64:
        return
    u1: Expr = Const(0)
    for (c, ext, place), n in zip(digits, names):
        if n in sol:
            u1 = u1 + sol[n] * place
    for values in itertools.product(*[range(ext) for ext, _ in free]):
        yield u1 + sum((v * place for v, (_, place) in zip(values, free) if v), Const(0)), sol


def _split_flat(sol: dict | None, width: int) -> dict | None:
    """A solution with the flat digit k becomes one in i = k // width and j = k % width."""
    if sol is None or "k" not in sol:
        return sol
    k = sol.pop("k")
    return {**sol, "i": k // width, "j": k % width}


def _flat_extent(w: MemorySlice, w_units, buffers) -> int | None:
    """1 + the largest row-major position i * width + j the writer writes, when that run ends
    inside a segment (a partial last segment); None otherwise."""
    if w.valid is None or len(w_units) == 0 or w.num == 1:
        return None
    try:
        m = w.mask(np.asarray(w_units), buffers).reshape(len(w_units), w.num * w.width)
    except KeyError:
        return None
    pos = np.nonzero(m.any(axis=0))[0]
    if not pos.size or int(pos.max()) + 1 != pos.size or pos.size % w.width == 0:
        return None   # not one leading run, or whole segments (the i, j digits already fit)
    return int(pos.size)


def _tries(w: MemorySlice, w_units, r: MemorySlice, r_units, parallel: Parallel, need: str | None,
           buffers=None) -> list[Coords]:
    tries = []
    extents, flat = _writer_extents(w, w_units, buffers)
    if w.pattern() == r.pattern() and (w_units is r_units or np.array_equal(w_units, r_units)):
        tries.append(Coords(U, I, J))
    for same_unit in ((True,) if need in ("unit", "lane") else (True, False)):
        for u1, sol in _candidates(w, parallel, same_unit, extents, flat):
            m = {"addr": r.index}
            tries.append(Coords(substitute(u1, m), substitute(sol.get("i", Const(0)), m),
                                substitute(sol.get("j", Const(0)), m)))
    return list(dict.fromkeys(tries))   # a map found twice is evaluated once (its answer is the same)


def _writer_extents(w: MemorySlice, w_units, buffers) -> tuple[tuple[int, int], int | None]:
    """(_extents, _flat_extent) of a writer: a function of the writer alone, which every reader of
    it and every try of coordinates asks about (remembered where nothing loads)."""
    if _slice_loads(w):
        return _extents(w, w_units, buffers), _flat_extent(w, sampled_units(w_units, w.count), buffers)
    key = (unnamed(w), units_key(w_units))
    hit = _EXTENTS.get(key, _MISS)
    if hit is _MISS:
        hit = _EXTENTS.put(key, (_extents(w, w_units, None), _flat_extent(w, sampled_units(w_units, w.count), None)))
    return hit


def _slice_loads(s: MemorySlice) -> bool:
    return bool(loads(s.index)) or (s.valid is not None and bool(loads(s.valid)))


class _Memo(dict):
    """A bounded memo table for the pure slice questions below. The greedy rewriter asks them
    again after every unrelated rewrite, and the search again for every plan sharing the
    exchange; without gathers the answers depend only on the slices and the unit sets."""

    def __init__(self, size: int = 4096):
        super().__init__()
        self.size = size

    def put(self, key, value):
        if len(self) >= self.size:
            self.clear()
        self[key] = value
        return value


_COORDS = _Memo()     # writer_coords
_COMPACT = _Memo()    # compact
_EXTENTS = _Memo(1024)   # _writer_extents
_MISS = object()


def writer_coords(w: MemorySlice, w_units: np.ndarray, r: MemorySlice, r_units: np.ndarray,
                  parallel: Parallel, need: str | None, buffers=None) -> Coords | None:
    """Coordinates of the writer element each valid reader element reads, checked exactly.

    need: None (any unit may read it), "group" (same group), "unit" (same unit) or "lane"
    (same unit and lane). The writer must write each address at most once."""
    if _slice_loads(w) or _slice_loads(r):   # the answer depends on the data: not memoised
        return _writer_coords(w, w_units, r, r_units, parallel, need, buffers)
    key = (unnamed(w), unnamed(r), parallel, need, units_key(w_units), units_key(r_units))   # names: not read
    hit = _COORDS.get(key, _MISS)
    if hit is _MISS:
        hit = _COORDS.put(key, _writer_coords(w, w_units, r, r_units, parallel, need, None))
    return hit


def _writer_coords(w: MemorySlice, w_units: np.ndarray, r: MemorySlice, r_units: np.ndarray,
                   parallel: Parallel, need: str | None, buffers=None) -> Coords | None:
    if not _injective(w, w_units, parallel, buffers):
        return None
    r_units = sampled_units(r_units, r.count, exprs=(r.index, w.index))
    reader: dict = {}
    for c in _tries(w, w_units, r, r_units, parallel, need, buffers):
        ev = _evaluate(w, w_units, r, r_units, c, parallel, need, buffers, reader)
        if ev is not None and bool(np.all(ev[0] | ~ev[2])):
            return c
    return None


SAMPLE_CAP = 1 << 16  # elements; larger checks look at a sample of units (first, last, seeded random)


def sampled_units(units: np.ndarray, per_unit: int, cap: int = SAMPLE_CAP, exprs=()) -> np.ndarray:
    """All units when the check is small; otherwise a fixed sample of them, so compile time
    does not grow with tensor size (an exact check of every unit is kept for small shapes,
    which the tests exercise; templates' patterns are uniform across units). The sample
    holds probe units that set each digit of u on its own (powers of two, and multiples of the
    divisors in `exprs`): a few random units alone leave the digits correlated, and a fit or
    check on them can accept an index that is wrong elsewhere."""
    units = np.asarray(units, dtype=np.int64)
    keep = max(8, cap // max(per_unit, 1))
    if len(units) <= keep:
        return units
    key = (units_key(units), keep, exprs)   # the rules ask for the same sample again and again
    hit = _SAMPLES.get(key)
    if hit is None:
        hit = _SAMPLES.put(key, _sample_of(units, keep, exprs))
    return hit


_SAMPLES = _Memo(1024)


def _sample_of(units: np.ndarray, keep: int, exprs) -> np.ndarray:
    rng = np.random.default_rng(len(units))
    head = min(keep // 4, len(units))
    picks = np.concatenate([units[:head], units[-head:], rng.choice(units, keep - 2 * head, replace=False),
                            _probes(units, exprs)])
    out = np.unique(picks)
    out.flags.writeable = False   # shared through the memo
    return out


def _probes(units: np.ndarray, exprs) -> np.ndarray:
    """Units among `units` that exercise each radix digit: 2^k and 2^k - 1, and for each
    divisor d in `exprs` d - 1, d, d + 1, 2d - 1 and 2d (offset by the first unit)."""
    top = int(units.max()) + 1
    base = int(units.min())
    cand = {base + (1 << k) for k in range(top.bit_length())} | {base + (1 << k) - 1 for k in range(top.bit_length())}
    for e in exprs:
        for d in _all_divisors(e):
            cand |= {base + x for x in (d - 1, d, d + 1, 2 * d - 1, 2 * d)}
    cand = np.fromiter(sorted(c for c in cand if base <= c < top), dtype=np.int64)
    return cand[np.isin(cand, units)]


def covering_coords(w: MemorySlice, w_units: np.ndarray, r: MemorySlice, r_units: np.ndarray,
                    parallel: Parallel, need: str | None, buffers=None):
    """For one of several writers: (coords, covered) where `covered` [units, num*width] marks the
    valid reader elements this writer wrote (coords exact there, `need` met; read-only); None if
    unsure."""
    if _slice_loads(w) or _slice_loads(r):   # the answer depends on the data: not memoised
        return _covering_coords(w, w_units, r, r_units, parallel, need, buffers)
    # the split rule asks again for every plan that keeps the concat/split (Swin-T: 1244 calls,
    # 528 distinct questions)
    key = (unnamed(w), unnamed(r), parallel, need, units_key(w_units), units_key(r_units))
    hit = _COVERING.get(key, _MISS)
    if hit is _MISS:
        hit = _COVERING.put(key, _covering_coords(w, w_units, r, r_units, parallel, need, None))
    return hit


_COVERING = _Memo(1024)


def _covering_coords(w: MemorySlice, w_units: np.ndarray, r: MemorySlice, r_units: np.ndarray,
                     parallel: Parallel, need: str | None, buffers=None):
    if not _injective(w, w_units, parallel, buffers):
        return None
    best, reader = None, {}
    for c in _tries(w, w_units, r, r_units, parallel, need, buffers):
        ev = _evaluate(w, w_units, r, r_units, c, parallel, need, buffers, reader)
        if ev is None:
            continue
        ok, hit, rmask = ev
        if np.any(hit & ~ok & rmask):
            continue      # this writer wrote an element read here, but not as `need` allows
        covered = hit & rmask
        if best is None or covered.sum() > best[1].sum():
            best = (c, covered)
    if best is None:
        return None
    covered = best[1].reshape(len(r_units), -1)
    covered.flags.writeable = False   # shared through the memo
    return best[0], covered


def evaluate_coords(w: MemorySlice, w_units: np.ndarray, r: MemorySlice, r_units: np.ndarray, c: Coords,
                    parallel: Parallel, need: str | None, buffers=None, reader: dict | None = None) -> np.ndarray | None:
    """`covered` [units, num*width] of one writer at coordinates `c` found elsewhere (on a sample),
    over exactly `r_units`: the valid reader elements it wrote there; None where it wrote one
    but not as `need` allows, or the answer depends on runtime data. `reader`: as `_evaluate`'s."""
    ev = _evaluate(w, w_units, r, r_units, c, parallel, need, buffers, reader)
    if ev is None:
        return None
    ok, hit, rmask = ev
    if np.any(hit & ~ok & rmask):
        return None
    return (hit & rmask).reshape(len(r_units), -1)


def injective_exactly(w: MemorySlice, w_units, parallel: Parallel, buffers=None) -> bool:
    """`_injective` over every unit, however many (no sample): for rules that must be exact."""
    w_units = np.asarray(w_units, np.int64)
    if _slice_loads(w):   # the answer depends on the data: not memoised
        return _injective_on(w, w_units, parallel, buffers, sample=False)
    key = (unnamed(w), parallel, units_key(w_units))
    hit = _INJECTIVE_EXACTLY.get(key, _MISS)
    if hit is _MISS:
        hit = _INJECTIVE_EXACTLY.put(key, _injective_on(w, w_units, parallel, None, sample=False))
    return hit


_INJECTIVE_EXACTLY = _Memo(1024)   # the split rule confirms the same writers again after other rewrites


def grid(units, num, width):
    """The u, i, j variables over a slice's grid (broadcastable), for `evaluate`."""
    return {"u": np.asarray(units, np.int64)[:, None, None], "i": np.arange(num)[None, :, None],
            "j": np.arange(width)[None, None, :]}


def _full(x, shape):
    return np.broadcast_to(np.asarray(x, dtype=np.int64), shape)


def eval_over(e: Expr | None, units, num: int, width: int, buffers=None) -> np.ndarray:
    """[units, num, width] boolean/int values of an expression over a slice's grid (None: True)."""
    shape = (len(units), num, width)
    if e is None:
        return np.ones(shape, bool)
    return np.broadcast_to(evaluate(e, grid(units, num, width), buffers), shape)


def _evaluate(w, w_units, r, r_units, c: Coords, parallel, need, buffers, reader: dict | None = None):
    """(ok, hit, rmask) over the reader grid: hit = the writer wrote the element read, at these
    coordinates; ok = hit and `need` holds; rmask = the reader reads it. None when undecidable.
    `reader`: a dict the caller keeps across its tries of coordinates for the same reader and
    units; the reader's grid, addresses and mask are evaluated once into it (read-only after)."""
    shape = (len(r_units), r.num, r.width)
    if len(r_units) == 0:
        z = np.zeros(shape, bool)
        return z, z, z
    reader = {} if reader is None else reader
    try:
        if "addr" not in reader:
            # one memo of subexpression values over the reader's grid: the tries' coordinates are
            # built from the reader's index and share its subexpressions
            env, seen = grid(r_units, r.num, r.width), {}
            addr = _full(evaluate(r.index, env, buffers, seen), shape)
            rmask = _full(evaluate(r.valid, env, buffers, seen), shape).astype(bool) if r.valid is not None \
                else np.ones(shape, bool)
            reader.update(env=env, addr=addr, rmask=rmask, seen=seen)
        env, addr, rmask, seen = reader["env"], reader["addr"], reader["rmask"], reader["seen"]
        u1, i1, j1 = (_full(evaluate(e, env, buffers, seen), shape) for e in (c.u, c.i, c.j))
        inside = member_mask(u1, w_units) & (i1 >= 0) & (i1 < w.num) & (j1 >= 0) & (j1 < w.width)
        wenv = {"u": np.where(inside, u1, w_units[0] if len(w_units) else 0), "i": np.where(inside, i1, 0),
                "j": np.where(inside, j1, 0)}
        wseen: dict = {}   # the writer's index and valid share subexpressions too
        waddr = _full(evaluate(w.index, wenv, buffers, wseen), shape)
        wvalid = _full(evaluate(w.valid, wenv, buffers, wseen), shape).astype(bool) if w.valid is not None else True
    except KeyError:      # a gather index from runtime data: cannot be decided statically
        return None
    hit = inside & (waddr == addr) & wvalid
    ok = hit.copy()
    if need in ("unit", "lane"):
        ok &= u1 == env["u"]
    if need == "group":
        ok &= u1 // parallel.units_per_group == env["u"] // parallel.units_per_group
    if need == "lane":
        ok &= (j1 // w.vec) % parallel.lanes == (env["j"] // r.vec) % parallel.lanes
    return ok, hit, rmask


def _injective(w: MemorySlice, w_units, parallel: Parallel, buffers) -> bool:
    """No element written twice by this slice (keyed by owner group/unit below GLOBAL).
    Beyond SAMPLE_CAP elements the check covers a fixed sample of units (see `sampled_units`)."""
    w_units = np.asarray(w_units, np.int64)
    if buffers is not None and (loads(w.index) or (w.valid is not None and loads(w.valid))):
        return _injective_on(w, w_units, parallel, buffers)
    key = (unnamed(w), parallel, units_key(w_units))
    if key not in _INJECTIVE:
        if len(_INJECTIVE) > 4096:
            _INJECTIVE.clear()
        _INJECTIVE[key] = _injective_on(w, w_units, parallel, None)
    return _INJECTIVE[key]


_INJECTIVE: dict = {}   # (slice, parallel, units) -> bool: the same writer is asked about by many readers


def _injective_on(w: MemorySlice, w_units, parallel: Parallel, buffers, sample: bool = True) -> bool:
    if sample:
        w_units = sampled_units(w_units, w.count, exprs=(w.index,))
    elif buffers is None:
        known = injective_by_period(w, w_units, parallel)
        if known is not None:
            return known
    return not _repeats(_keyed_addresses(w, w_units, parallel, buffers))


def _keyed_addresses(w: MemorySlice, w_units, parallel: Parallel, buffers) -> np.ndarray:
    """The valid addresses the slice writes over these units, sorted, each keyed by its owner
    below GLOBAL (shared memory by group, registers by unit): a repeat is an element written twice."""
    addr = w.addresses(w_units, buffers)
    m = w.mask(w_units, buffers)
    u = np.asarray(w_units, np.int64)[:, None]
    owner = u // parallel.units_per_group if w.level == Level.SHARED else u if w.level == Level.REGISTER else 0
    return np.sort((addr + owner * (int(addr.max(initial=0)) + 1))[m], kind="stable")


def _repeats(vals: np.ndarray) -> bool:
    return bool(np.any(vals[1:] == vals[:-1]))


def injective_by_period(w: MemorySlice, w_units, parallel: Parallel) -> bool | None:
    """The exact answer of `_injective_on` over consecutive units from one period of them, or
    None where this argument does not settle it. With the slice's index quasi-periodic in u
    (gir/periodic.py: index(u + P) = index(u) + S for every u, i, j) and its validity periodic
    (valid(u + P) = valid(u)), the units' valid addresses are block 0's shifted by q S in block q
    (a last, partial block: part of a shifted block 0). REGISTER and SHARED slices are keyed by
    their owner (unit, group; the period made a multiple of the group): an owner repeats the
    duplicates of the owner one period before it, so block 0 decides. GLOBAL slices: a duplicate
    in block 0 is one of all units (False); if block 0 has none and its addresses span less than
    |S|, the shifted blocks lie in disjoint ranges (True); else None. A batch of 8 images
    checks one image's units instead of eight (Swin-T at batch 8: 26 of 60 CPU seconds of one
    search were these checks over every unit)."""
    from math import lcm

    from powerfusion.gir.periodic import GAIN, consecutive, shape
    units = np.asarray(w_units, np.int64)
    if units.size < 2 or not consecutive(units):
        return None
    index = shape(w.index)
    valid = (1, 0) if w.valid is None else shape(w.valid)
    if index is None or valid is None or valid[1] != 0:
        return None
    period = lcm(index[0], valid[0], parallel.units_per_group if w.level == Level.SHARED else 1)
    slope = index[1] * (period // index[0])
    if units.size < GAIN * period:
        return None
    vals = _keyed_addresses(w, units[:period], parallel, None)
    if _repeats(vals):
        return False
    if w.level != Level.GLOBAL:
        return True
    if slope == 0:   # block 1 writes block 0's addresses again
        return vals.size == 0
    return True if vals.size == 0 or int(vals[-1]) - int(vals[0]) < abs(slope) else None


_NEED = {Level.REGISTER: "lane", Level.SHARED: "group", Level.GLOBAL: None}
_ORDER = (None, "group", "unit", "lane")


def composition_need(source: Level, through: Level) -> str | None:
    """What reading `source` data via an intermediate at level `through` requires of the units:
    register data stays in its lane (no shuffles in a move); the intermediate's own level binds
    too (a unit reads its own registers, a group its own shared memory)."""
    via = {Level.REGISTER: "unit", Level.SHARED: "group", Level.GLOBAL: None}[through]
    return max(_NEED[source], via, key=_ORDER.index)


def _all_divisors(e) -> set[int]:
    """The constant divisors (> 1) of the // and % in `e` (not under a load's index)."""
    out: set[int] = set()
    _collect_divisors(e, out, set())
    return out


def _collect_divisors(e, out: set[int], seen: set[int]) -> None:
    # a subexpression met again is walked once (by identity): composed index maps share them,
    # and the tree walk took 3 million calls for Swin-T's plans
    if not isinstance(e, (BinOp, Select)) or id(e) in seen:
        return
    seen.add(id(e))
    if isinstance(e, BinOp):
        _collect_divisors(e.a, out, seen)
        _collect_divisors(e.b, out, seen)
        if e.op in ("floordiv", "mod") and isinstance(e.b, Const) and e.b.value > 1:
            out.add(e.b.value)
    else:
        for x in (e.cond, e.a, e.b):
            _collect_divisors(x, out, seen)


def _factors(ds) -> list[int]:
    out = set()
    for d in ds:
        out |= {f for f in range(2, d + 1) if d % f == 0}
    return sorted(out)


def _digit_chain(divisors: list[int], extent: int) -> list[int]:
    """Radix boundaries 1 = b0 < b1 < ... (each dividing the next, all below `extent`)."""
    chain = [1]
    for d in divisors:
        if d < extent and d % chain[-1] == 0:
            chain.append(d)
    return chain


def _digit_expr(var: Expr, lo: int, hi: int | None, extent: int) -> Expr:
    e = var // lo
    return e if hi is None or hi >= extent else e % (hi // lo)


def _fit(e: Expr, units: np.ndarray, num: int, width: int, where: np.ndarray, buffers=None,
         over: "GridValues | None" = None) -> Expr | None:
    """An affine form in the digits of u, i, j equal to `e` wherever `where` holds, or None.
    `over`: the grid's values already computed by the caller (shared subexpressions)."""
    over = over or GridValues(units, num, width, buffers)
    env = over.env
    full: list = []   # e over the whole grid, evaluated once and only for a chain that fits its sampled rows

    def values() -> np.ndarray:
        if not full:
            full.append(_full(over.value(e), (len(units), num, width)))
        return full[0]
    for factors in _chain_sources(_all_divisors(e)):
        f = _fit_chain(list(factors), e, env, values, units, num, width, where, buffers)
        if f is not None:
            return f
    return None


CHAINS_TRIED = 8   # radix chains _fit tries beyond the first


def _chain_sources(divisors: set[int]) -> list[tuple[int, ...]]:
    """Sorted divisor lists whose greedy radix chain `_fit` tries, in order: every factor of the
    divisors (fine digits: powers of two first), then chains started at each divisor or ratio of
    two divisors (a composed channel shuffle's (u % 116) // 2 + (u % 2) * 116 needs the chain
    2, 116, 232, which the powers of two of the first chain miss)."""
    first = tuple(_factors(divisors))
    ratios = {a // b for a in divisors for b in divisors if a > b and a % b == 0}
    cands = sorted(divisors | ratios)
    out = [first]
    for start in cands[:CHAINS_TRIED]:
        chain = tuple(d for d in cands if d >= start and d % start == 0)
        if chain not in out:
            out.append(chain)
        if len(out) > CHAINS_TRIED:
            break
    return out


def _fit_chain(factors: list[int], e: Expr, env, values, units, num: int, width: int, where: np.ndarray,
               buffers=None) -> Expr | None:
    """_fit with the digits of u, i and j cut at the radix chain `factors` gives. The form is
    solved on sampled elements, where `e` is evaluated alone; only a form that holds there is
    checked on every element (`values()`: e over the whole grid)."""
    shape = (len(units), num, width)
    # A digit depends on one axis only, so its values are computed on that axis and broadcast
    # (or picked at the sampled elements) instead of over every element (the same numbers).
    size = len(units) * num * width
    dense = size > 0 and bool(where.all())
    target_size = size if dense else int(np.count_nonzero(where))
    # the axis positions holding a selected element: each digit's extent is the largest seen there
    present = None if dense else (where.any(axis=(1, 2)), where.any(axis=(0, 2)), where.any(axis=(0, 1)))
    digits = []   # (var, lo, hi, extent used, values along its axis, axis)
    for axis, (var, ext) in enumerate(((U, int(units.max()) + 1), (I, num), (J, width))):
        if ext <= 1:
            continue
        vals = env[var.name].reshape(-1)
        used = vals if dense else vals[present[axis]]
        seen = int(used.max()) + 1 if used.size else 1
        chain = _digit_chain(factors, ext)
        for lo, hi in zip(chain, chain[1:] + [None]):
            digits.append((var, lo, hi, seen, (vals // lo) % (hi // lo) if hi else vals // lo, axis))
    rows = np.arange(target_size)
    if target_size > 4 * (len(digits) + 1):   # solve on a sample, check on every element below
        rows = np.random.default_rng(0).choice(target_size, min(target_size, 4 * (len(digits) + 1) + 64), replace=False)
    # element r of the flattened grid is (r // (num*width), r // width % num, r % width)
    flat = rows if dense else np.flatnonzero(where.reshape(-1))[rows]
    at = (flat // (num * width), flat // width % num, flat % width)
    cols = [d[4][at[d[5]]] for d in digits]
    sample = np.broadcast_to(evaluate(e, {"u": env["u"].reshape(-1)[at[0]], "i": at[1], "j": at[2]}, buffers),
                             rows.shape).astype(np.int64)
    A = np.stack([np.ones(rows.size)] + [c.astype(np.float64) for c in cols], axis=1)
    coef = np.rint(np.linalg.lstsq(A, sample.astype(np.float64), rcond=None)[0]).astype(np.int64)
    if not np.array_equal(A @ coef.astype(np.float64), sample.astype(np.float64)):
        return None   # wrong on the sampled elements already: no need to look at the others
    full = values()
    target = full if dense else full[where]
    got = np.full(shape, coef[0], np.int64)
    for d, c in zip(digits, coef[1:]):
        if c:
            got += (d[4] * c).reshape([-1 if k == d[5] else 1 for k in range(3)])
    if not np.array_equal(got if dense else got[where], target):
        return None
    out: Expr = Const(int(coef[0]))
    run = None   # (var, lo, base coefficient, next lo, extent): digits that form one wider digit
    for (var, lo, hi, ext, _, _), c in zip(digits, coef[1:]):
        if run and run[0] == var and run[3] == lo and c == run[2] * (lo // run[1]) and c:
            run = (var, run[1], run[2], hi, ext)
            continue
        if run:
            out = out + _digit_expr(run[0], run[1], run[3], run[4]) * int(run[2])
        run = (var, lo, int(c), hi, ext) if c else None
    if run:
        out = out + _digit_expr(run[0], run[1], run[3], run[4]) * int(run[2])
    return out


_COMPARE = ("lt", "le", "eq", "ne")
COMPACT_CAP = 1 << 18  # elements; larger slices are refitted on a sample of units (`sampled_units`)
_WORTH_FITTING = 12   # expression nodes: smaller sides are left as they are


def _size(e: Expr) -> int:
    if isinstance(e, BinOp):
        return 1 + _size(e.a) + _size(e.b)
    if isinstance(e, Select):
        return 1 + _size(e.cond) + _size(e.a) + _size(e.b)
    return 1


class GridValues:
    """Expressions evaluated over one slice grid with one memo of subexpression values: a
    composed mask's conjuncts, their sides and the slice's index share most of their nodes."""

    def __init__(self, units, num: int, width: int, buffers=None):
        self.env, self.buffers, self.seen = grid(units, num, width), buffers, {}
        self.shape = (len(units), num, width)

    def value(self, e: Expr | None) -> np.ndarray:
        if e is None:
            return np.ones(self.shape, bool)
        return np.broadcast_to(evaluate(e, self.env, self.buffers, self.seen), self.shape)

    def truth(self, e: Expr | None) -> np.ndarray:
        return self.value(e).astype(bool)


def compact_mask(e: Expr, units: np.ndarray, num: int, width: int, buffers=None,
                 over: GridValues | None = None) -> Expr:
    """A valid mask with always-true comparisons dropped and each compared side refitted
    (exactly, on every element: the mask itself decides which elements count). In a
    conjunction a comparison only matters where the others hold: it is dropped where they imply
    it, and its sides are refitted there (a composed shuffle's 'plane index % 232 < 116' is a
    function of the unit alone inside the plane, 'i * 128 + j < 784')."""
    over = over or GridValues(units, num, width, buffers)
    parts = conjuncts(e)
    vals = [over.truth(p) for p in parts]
    keep = list(range(len(parts)))
    out = list(parts)
    for k in range(len(parts)):
        if not (isinstance(parts[k], BinOp) and parts[k].op in _COMPARE) or loads(parts[k]):
            continue
        where = np.ones((len(units), num, width), bool)
        for m in keep:
            if m != k:
                where &= vals[m]
        if bool(np.all(vals[k] | ~where)):
            keep.remove(k)     # implied by the others (or always true)
            continue
        sides = []
        for side in (parts[k].a, parts[k].b):
            # a small side is refitted too where the others narrow the elements: it may lose
            # its dependence on i and j there (then the condition is one on the unit alone)
            small = _size(side) < _WORTH_FITTING and (bool(where.all()) or variables(side) <= {"u"})
            f = None if small else _fit(side, units, num, width, where, buffers, over)
            better = f is not None and (_size(f) < _size(side) or len(variables(f)) < len(variables(side)))
            sides.append(f if better else side)
        out[k] = binop(parts[k].op, sides[0], sides[1])
        # later conjuncts are refitted under this one as it now reads: each step keeps the
        # conjunction exact (a term changed only where all the others, as they are, hold), where
        # refitting two terms each under the other's original form is not (both may turn true
        # where both were false: a ConvTranspose's zero-stuffing mask kept the odd rows)
        vals[k] = over.truth(out[k])
    result: Expr = Const(1)
    for k in keep:
        result = out[k] if result == Const(1) else binop("and", result, out[k])
    return result


def conjuncts(e: Expr) -> list[Expr]:
    """The terms of a conjunction ('and' nested any way), in order."""
    if isinstance(e, BinOp) and e.op == "and":
        return conjuncts(e.a) + conjuncts(e.b)
    return [e]


def compact(s: MemorySlice, units, buffers=None) -> MemorySlice:
    """The slice with its index rewritten as an affine form of the digits of u, i and j when
    that form gives the same address for every valid element, and its mask simplified
    (composition nests div/mod expressions; this keeps them small for later rules and for
    the renderer). An all-true valid mask becomes None."""
    units = np.asarray(units, np.int64)
    if len(units) == 0 or _slice_loads(s):
        return s
    # fill by repr: -0.0 == 0.0, but renders differently; the buffer's name is only carried over
    key = (unnamed(s), repr(s.fill), units_key(units))
    hit = _COMPACT.get(key)
    if hit is None:
        hit = _COMPACT.put(key, _compact(s, units))
    return hit if hit.buffer == s.buffer else replace(hit, buffer=s.buffer)


def _compact(s: MemorySlice, units: np.ndarray, buffers=None) -> MemorySlice:
    if len(units) * s.count > COMPACT_CAP:
        units = sampled_units(units, s.count, exprs=(s.index,) + ((s.valid,) if s.valid is not None else ()))
        # fitted and checked on a sample of units with digit probes, as above
    valid_expr = s.valid
    over = GridValues(units, s.num, s.width, buffers)
    if valid_expr is not None:
        valid_expr = compact_mask(valid_expr, units, s.num, s.width, buffers, over)
        valid_expr = None if valid_expr == Const(1) else valid_expr
    valid = over.truth(valid_expr)
    index = s.index
    if _size(index) >= _WORTH_FITTING and valid.any():
        f = _fit(index, units, s.num, s.width, valid, buffers, over)
        index = f if f is not None else index
    return MemorySlice(s.buffer, s.level, index, s.num, s.width, s.dtype, s.vec, valid_expr, s.fill)
