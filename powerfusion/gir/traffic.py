"""Modelled memory traffic of a GIR graph: bytes moved at each memory level.

Every gOperator but `sync` moves the elements of each of its slices once, at that slice's
level: a move reads its input and writes its output, a compute gOperator reads its inputs
and writes its output (compute runs on registers, so that is register traffic). A slice
counts `num * width` elements per active unit, times the element size.

Approximations (stated, since the rules only need a consistent order):
* valid masks: elements where `valid` is false are not counted; the mask is evaluated on
  at most `MASK_SAMPLE` units spread over the active ones and scaled up;
* guards and masks that gather from runtime data count as "every unit / element";
* gather index reads (`load` in an index) are not counted (they are tiny next to data);
* no caches: a global element read twice counts twice.
"""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import loads
from powerfusion.gir.ir import GIRGraph, GOp, Level, MemorySlice, Parallel, Sync, units_key

LEVELS = tuple(lv.label for lv in sorted(Level, reverse=True))   # ("global", "shared", "register")
MASK_SAMPLE = 256


def _itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    return np.dtype(dtype).itemsize


def _units(op: GOp, parallel: Parallel) -> np.ndarray:
    if op.guard is not None and loads(op.guard):
        return np.arange(parallel.units)
    return op.active_units(parallel.units)


def _elements(s: MemorySlice, units: np.ndarray) -> float:
    if s.valid is None or loads(s.valid) or len(units) == 0:
        return float(s.count * len(units))
    key = (s.valid, s.num, s.width, units_key(units))   # the same mask recurs in the ops of every rewrite
    hit = _VALID_SHARE.get(key)
    if hit is None:
        sample = units if len(units) <= MASK_SAMPLE else units[np.linspace(0, len(units) - 1, MASK_SAMPLE).astype(np.int64)]
        if len(_VALID_SHARE) >= 1 << 14:
            _VALID_SHARE.clear()
        hit = _VALID_SHARE[key] = s.mask(sample).mean()
    return float(hit * s.count * len(units))


_VALID_SHARE: dict = {}   # (mask, num, width, units) -> share of valid elements in the sample


_CACHE: dict[int, tuple[GOp, Parallel, tuple]] = {}


def op_traffic(op: GOp, parallel: Parallel) -> tuple[tuple[str, int], ...]:
    """(level label, bytes) pairs of one gOperator; remembered per op object (ops are immutable
    and shared by the successive graphs of a rewrite, so hashing them each time would dominate)."""
    hit = _CACHE.get(id(op))
    if hit is not None and hit[0] is op and hit[1] == parallel:
        return hit[2]
    if len(_CACHE) > 200_000:
        _CACHE.clear()
    out = _op_traffic(op, parallel)
    _CACHE[id(op)] = (op, parallel, out)
    return out


def _op_traffic(op: GOp, parallel: Parallel) -> tuple[tuple[str, int], ...]:
    if isinstance(op.args, Sync):
        return ()
    units = _units(op, parallel)
    out: dict[str, float] = {}
    for s in op.inputs + op.outputs:
        out[s.level.label] = out.get(s.level.label, 0.0) + _elements(s, units) * _itemsize(s.dtype)
    return tuple((k, int(round(v))) for k, v in out.items())


def traffic(graph: GIRGraph) -> dict[str, int]:
    """Bytes moved at each level: {'global': .., 'shared': .., 'register': ..}."""
    total = dict.fromkeys(LEVELS, 0)
    for op in graph.ops:
        for level, b in op_traffic(op, graph.parallel):
            total[level] += b
    return total


def traffic_after(before: GIRGraph, before_traffic: dict[str, int], after: GIRGraph) -> dict[str, int]:
    """traffic(after) from traffic(before), visiting only the gOperators that changed (by identity:
    a rewrite keeps its untouched gOperators as the same objects)."""
    if after.parallel != before.parallel:
        return traffic(after)
    last = _LAST_AFTER[0]   # a rule's own check (rewrite/base.if_not_worse), then the driver's, ask the same
    if last is not None and last[0] is before and last[1] is after and last[2] == before_traffic:
        return dict(last[3])
    out = _traffic_after(before, before_traffic, after)
    _LAST_AFTER[0] = (before, after, dict(before_traffic), dict(out))   # the graphs held: their ids stay theirs
    return out


_LAST_AFTER: list = [None]   # (before, after, before's traffic, after's traffic) of the last call


def _traffic_after(before: GIRGraph, before_traffic: dict[str, int], after: GIRGraph) -> dict[str, int]:
    old = {id(op): op for op in before.ops}
    new = {id(op): op for op in after.ops}
    out = dict(before_traffic)
    for key in old.keys() - new.keys():
        for level, b in op_traffic(old[key], before.parallel):
            out[level] -= b
    for key in new.keys() - old.keys():
        for level, b in op_traffic(new[key], after.parallel):
            out[level] += b
    return out


def total_bytes(t: dict[str, int]) -> int:
    return sum(t.values())


def kernel_count(graph: GIRGraph) -> int:
    """Kernels after splitting at the DEVICE syncs that remain (GIRGraph.kernels())."""
    return len(graph.kernels())


def not_worse(before: dict[str, int], after: dict[str, int]) -> bool:
    """The rewriting invariant: global bytes do not rise, and total bytes do not rise unless global
    bytes fall (register and shared traffic is what a rewrite trades DRAM traffic for: keeping an
    output's rounded value in registers for a later reader adds register bytes and removes a DRAM
    read). Lexicographic, like the driver's termination measure, which begins with these two."""
    if after["global"] != before["global"]:
        return after["global"] < before["global"]
    return total_bytes(after) <= total_bytes(before)
