"""Sync scope of a write followed by a read (docs/design.md, "GIR concepts"), decided exactly.

For every element the read touches that the write wrote, compare who wrote it with who
reads it: same unit and same lane -> LANE; same unit, other lane -> WARP; same group
(block), other unit -> BLOCK; otherwise DEVICE. The answer is the largest over all
elements. Elements are keyed per memory level: GLOBAL by address, SHARED by (group,
address), REGISTER by (unit, address) -- register data never crosses units.

Beyond `CAP` evaluated elements the question is answered exactly on a sample of whole
groups (the first, the last and seeded random ones): the reads of the sampled groups'
units against the writes of the same units; a read element written by none of them was
written by another group (DEVICE). Templates give every unit the same access pattern up
to its offset, so the sample decides for all; the exact check over every element is kept
below the cap, which the tests exercise. Slices whose index loads data (gather) are
answered structurally without the data: the same pattern on the same buffer, read by the
same units, is LANE; anything else DEVICE.
"""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import loads
from powerfusion.gir.ir import Level, MemorySlice, Parallel, Scope, sorted_once as is_sorted_units, units_key, unnamed

CAP = 1 << 18      # evaluated elements checked exactly
SAMPLE = 1 << 16   # elements looked at beyond CAP


def _uses_loads(s: MemorySlice) -> bool:
    return bool(loads(s.index)) or (s.valid is not None and bool(loads(s.valid)))


def element_owners(s: MemorySlice, units: np.ndarray, parallel: Parallel, buffers=None):
    """Flat arrays (key, unit, lane) of the valid elements `units` touch through `s`.
    `key` identifies the element across units at the slice's level."""
    units = np.asarray(units, dtype=np.int64)
    addr = s.addresses(units, buffers)
    mask = s.mask(units, buffers)
    u = np.broadcast_to(units[:, None], addr.shape)
    lane = np.broadcast_to(s.lanes_of(parallel.lanes)[None, :], addr.shape)
    addr, u, lane = addr[mask], u[mask], lane[mask]
    if s.level == Level.GLOBAL:
        key = addr
    else:
        owner = u // parallel.units_per_group if s.level == Level.SHARED else u
        key = (owner << 32) + addr  # per-group / per-unit arrays: the owner is part of the key
    return key, u, lane


def _structural(write: MemorySlice, write_units, read: MemorySlice, read_units) -> Scope:
    same_units = write_units is read_units or np.array_equal(np.asarray(write_units), np.asarray(read_units))
    if write.buffer == read.buffer and write.level == read.level and write.pattern() == read.pattern() and same_units:
        return Scope.LANE
    return Scope.DEVICE


def needed_scope(write: MemorySlice, write_units, read: MemorySlice, read_units, parallel: Parallel,
                 buffers=None, cap: int = CAP) -> Scope:
    """The smallest sync scope that orders `write` (by `write_units`) before `read` (by
    `read_units`) on the same buffer. Elements read but not written here need nothing (LANE).
    `buffers` supplies data for index expressions that load (gather); without it such
    slices are answered structurally."""
    write_units = np.asarray(write_units, dtype=np.int64)
    read_units = np.asarray(read_units, dtype=np.int64)
    if write.buffer != read.buffer:
        return Scope.LANE
    if len(write_units) == 0 or len(read_units) == 0:
        return Scope.LANE
    loading = _uses_loads(write) or _uses_loads(read)
    if buffers is None and loading:
        return _structural(write, write_units, read, read_units)
    if loading:  # the answer depends on the data: not memoised
        return _needed_scope(write, write_units, read, read_units, parallel, buffers, cap)
    # The greedy rewriter asks the same question again after every unrelated rewrite, and the
    # search asks it again for every plan sharing the exchange: without loads the answer is a
    # pure function of the slices, the unit sets and the parallel structure (not of the buffer's
    # name: both touch the same buffer, whatever it is called in this plan).
    key = (unnamed(write), unnamed(read), parallel, cap, units_key(write_units), units_key(read_units))
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.clear()
        hit = _MEMO[key] = _needed_scope(write, write_units, read, read_units, parallel, None, cap)
    return hit


MEMO_SIZE = 4096
_MEMO: dict[tuple, Scope] = {}


def _needed_scope(write: MemorySlice, write_units: np.ndarray, read: MemorySlice, read_units: np.ndarray,
                  parallel: Parallel, buffers, cap: int) -> Scope:
    if len(write_units) * write.count + len(read_units) * read.count <= cap:
        wk, wu, wl = element_owners(write, write_units, parallel, buffers)
        rk, ru, rl = element_owners(read, read_units, parallel, buffers)
        return scope_between(wk, wu, wl, rk, ru, rl, parallel)
    groups = sample_groups(read_units, parallel.units_per_group, max(write.count, read.count), SAMPLE)
    write_units = _units_of_groups(write_units, groups, parallel.units_per_group)
    read_units = _units_of_groups(read_units, groups, parallel.units_per_group)
    wk, wu, wl = element_owners(write, write_units, parallel, buffers)
    rk, ru, rl = element_owners(read, read_units, parallel, buffers)
    # a GLOBAL element read here but written by none of the sampled units was written (if at
    # all) by a group outside the sample
    return scope_between(wk, wu, wl, rk, ru, rl, parallel, missing=Scope.DEVICE if read.level == Level.GLOBAL else None)


def _units_of_groups(units: np.ndarray, groups: np.ndarray, upg: int) -> np.ndarray:
    """The units of `units` in the given (sorted) groups: by binary search for each group's
    range when the units are sorted, so the cost follows the sample, not the unit count."""
    if not is_sorted_units(units):
        return units[np.isin(units // upg, groups)]
    lo = np.searchsorted(units, groups * upg)
    hi = np.searchsorted(units, (groups + 1) * upg)
    if not len(groups):
        return units[:0]
    return np.concatenate([units[a:b] for a, b in zip(lo.tolist(), hi.tolist())])


def sample_groups(units: np.ndarray, upg: int, per_unit: int, cap: int) -> np.ndarray:
    """Group ids to check: all when small, else the first, the last and seeded random groups,
    about `cap` elements in all."""
    groups = _distinct_sorted(np.asarray(units, np.int64) // upg)
    keep = max(4, cap // max(1, 2 * per_unit * upg))
    if len(groups) <= keep:
        return groups
    rng = np.random.default_rng(len(groups))
    ends = np.concatenate([groups[:2], groups[-2:]])
    return np.unique(np.concatenate([ends, rng.choice(groups, keep - 4, replace=False)]))


def _distinct_sorted(values: np.ndarray) -> np.ndarray:
    """np.unique in one linear pass where the values come sorted (active units always do)."""
    if values.size > 1 and not bool(np.all(values[1:] >= values[:-1])):
        return np.unique(values)
    if values.size <= 1:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


def scope_between(wk, wu, wl, rk, ru, rl, parallel: Parallel, missing: Scope | None = None) -> Scope:
    """Scope from owner arrays: writes (key, unit, lane) and reads (key, unit, lane).
    Several writers of one key are all compared (min and max suffice for 'differs').
    `missing`: the scope owed to a read key no write has (None: nothing is owed)."""
    if rk.size == 0:
        return Scope.LANE
    if wk.size == 0:
        return missing or Scope.LANE
    if wk.size > 1 and not np.all(wk[1:] >= wk[:-1]):   # row-major writes are often sorted already
        order = np.argsort(wk, kind="stable")
        wk, wu, wl = wk[order], wu[order], wl[order]
    # sorted: each run of equal keys starts where the key changes (np.unique would sort again)
    first = np.empty(wk.size, bool)
    first[0] = True
    np.not_equal(wk[1:], wk[:-1], out=first[1:])
    start = np.flatnonzero(first)
    uniq = wk[start]
    code = wu * (parallel.lanes + 1) + wl  # one integer per (unit, lane)
    grp = wu // parallel.units_per_group
    if start.size == wk.size:   # every key written once: each run is one element
        lo_code = hi_code = code
        lo_u = hi_u = wu
        lo_g = hi_g = grp
    else:
        lo_code, hi_code = np.minimum.reduceat(code, start), np.maximum.reduceat(code, start)
        lo_u, hi_u = np.minimum.reduceat(wu, start), np.maximum.reduceat(wu, start)
        lo_g, hi_g = np.minimum.reduceat(grp, start), np.maximum.reduceat(grp, start)
    pos = np.searchsorted(uniq, rk)
    pos_c = np.minimum(pos, len(uniq) - 1)
    hit = uniq[pos_c] == rk
    if missing is not None and not np.all(hit):
        return missing
    if not np.any(hit):
        return Scope.LANE
    p = pos_c[hit]
    r_code = ru[hit] * (parallel.lanes + 1) + rl[hit]
    r_u, r_g = ru[hit], ru[hit] // parallel.units_per_group
    if np.any((lo_g[p] != r_g) | (hi_g[p] != r_g)):
        return Scope.DEVICE
    if np.any((lo_u[p] != r_u) | (hi_u[p] != r_u)):
        return Scope.BLOCK
    if np.any((lo_code[p] != r_code) | (hi_code[p] != r_code)):
        return Scope.WARP
    return Scope.LANE
