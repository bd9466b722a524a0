"""Register -> register moves that stay inside each lane but change the pattern: a depthwise
conv's window built from the vector chunks a lane loaded (templates/ops_strip.py).

Register tiles live in the identity layout (element (i, j) of a W-wide tile is slot
i * W/lanes + (j // (lanes*vec)) * vec + j % vec of lane (j // vec) % lanes). A move whose
slices address their buffers otherwise is rendered here when every element it copies stays in
the lane that owns it on both sides and the slots it touches are the same in every lane: the
copy is then a fixed list of slot assignments, evaluated now, which the compiler turns into
register renaming. Anything else (data crossing lanes, slots depending on the unit) is not an
in-lane move; the caller reports it.
"""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import evaluate, variables
from powerfusion.gir.ir import Level, MemorySlice

MAX_ELEMENTS = 1 << 14   # elements per unit: beyond this the assignment list is not worth unrolling


def in_lane_slice(s: MemorySlice) -> bool:
    """A register slice whose index and mask depend on (i, j) only, as in-lane moves need."""
    used = variables(s.index) | (variables(s.valid) if s.valid is not None else frozenset())
    return s.level == Level.REGISTER and s.width > 1 and used <= {"i", "j"} and s.count <= MAX_ELEMENTS


def in_lane_assignments(src: MemorySlice, dst: MemorySlice, width: int, vec: int,
                        lanes: int) -> list[tuple[int, int | None]] | None:
    """[(dst slot, src slot or None for the fill)] that every lane performs, in element order;
    None when the move is not in-lane (see the module doc). `width`, `vec`: the two buffers'
    common register layout."""
    if not (in_lane_slice(src) and in_lane_slice(dst)) or src.num != dst.num or src.width != dst.width:
        return None
    i, j = np.meshgrid(np.arange(dst.num, dtype=np.int64), np.arange(dst.width, dtype=np.int64), indexing="ij")
    env = {"i": i, "j": j}
    lane = (j // src.vec) % lanes if src.vec == dst.vec else None
    if lane is None:
        return None
    d_ok = _mask(dst, env, i.shape)
    s_ok = _mask(src, env, i.shape) & d_ok
    d_idx = np.broadcast_to(evaluate(dst.index, env), i.shape)
    s_idx = np.broadcast_to(evaluate(src.index, env), i.shape)
    d_lane, d_slot = _owner(d_idx, width, vec, lanes)
    s_lane, s_slot = _owner(s_idx, width, vec, lanes)
    if np.any(d_ok & (d_lane != lane)) or np.any(s_ok & (s_lane != lane)):
        return None
    per_lane = []
    for ln in range(lanes):
        sel = d_ok & (lane == ln)
        per_lane.append([(int(d), int(s) if ok else None)
                         for d, s, ok in zip(d_slot[sel], s_slot[sel], s_ok[sel])])
    if any(p != per_lane[0] for p in per_lane[1:]):
        return None
    return per_lane[0]


def _mask(s: MemorySlice, env, shape) -> np.ndarray:
    if s.valid is None:
        return np.ones(shape, bool)
    return np.broadcast_to(evaluate(s.valid, env), shape).astype(bool)


def _owner(idx: np.ndarray, width: int, vec: int, lanes: int):
    """(lane, slot) of buffer element idx in the identity layout of a width-wide tile."""
    row, col = idx // width, idx % width
    return (col // vec) % lanes, row * (width // lanes) + (col // (lanes * vec)) * vec + col % vec
