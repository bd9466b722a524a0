"""The numpy interpreter of GIR: the semantic reference for every template and rule.

Units run in lockstep, one gOperator at a time over all active units (vectorised),
so a missing sync is not visible here: the verifier checks sync placement. A DEVICE sync
is a kernel boundary: register and shared buffers are poisoned there, as on hardware. Register
buffers are [units, size] arrays, shared buffers [groups, size], global buffers flat.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from powerfusion.gir.ir import (Broadcast, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Reduce, Scope, Sync)
from powerfusion.scalar import scalar_fn


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def compute_dtype(dt: np.dtype) -> np.dtype:
    """fp16/bf16 arithmetic is done in fp32, as every backend does it."""
    return np.dtype(np.float32) if dt.kind == "f" and dt.itemsize < 4 or dt.name == "bfloat16" else dt


_IDENTITY = {"sum": 0.0, "prod": 1.0, "max": -np.inf, "min": np.inf}
_REDUCE = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


def sumexp(v: np.ndarray, mask: np.ndarray | None, axis: int) -> np.ndarray:
    """Reduce(sumexp): the sum over the valid elements of exp(x - m), m their maximum, an element
    equal to m counting 1 (so +-inf maxima give counts, not NaN; ir.Reduce)."""
    mask = np.ones(v.shape, bool) if mask is None else mask
    with np.errstate(all="ignore"):
        m = np.max(np.where(mask, v, v.dtype.type(-np.inf)), axis=axis, keepdims=True)
        terms = np.where(v == m, v.dtype.type(1), np.exp(v - m))
    return np.sum(np.where(mask, terms, v.dtype.type(0)), axis=axis, dtype=v.dtype)


class _State:
    def __init__(self, graph: GIRGraph, feeds: Mapping[str, np.ndarray]):
        self.graph = graph
        self.arrays: dict[str, np.ndarray] = {}
        self.dirty: set[str] = set()   # register / shared buffers written since the last kernel boundary
        consts = dict(graph.constants)
        for b in graph.buffers:
            dt = np_dtype(b.dtype)
            if b.level == Level.GLOBAL:
                src = feeds.get(b.name, consts.get(b.name))
                if src is not None:
                    a = np.asarray(np.asarray(src).astype(dt, copy=False), order="C").reshape(-1).copy()
                    if a.size != b.size:
                        raise ValueError(f"buffer '{b.name}' holds {b.size} elements, fed {a.size}")
                else:
                    a = _poison(dt, b.size)
                self.arrays[b.name] = a
        # register and shared buffers: allocated (poisoned) on first use, with the rows of the
        # units that use them (`_rows`): a graph-wide units x size array for each took 5 s and
        # gigabytes where one kernel has 37632 units and another's 1176 units hold 49 x 32 windows
        self.local = {b.name: b for b in graph.buffers if b.level != Level.GLOBAL}

    def _rows(self, s: MemorySlice, units: np.ndarray) -> np.ndarray:
        """The array of a register / shared buffer, grown to cover `units` (new rows poisoned)."""
        b = self.local[s.buffer]
        upg = self.graph.parallel.units_per_group
        need = (int(units.max()) + 1 if len(units) else 0)
        if b.level == Level.SHARED:
            need = -(-need // upg)
        arr = self.arrays.get(s.buffer)
        if arr is None or arr.shape[0] < need:
            dt = np_dtype(b.dtype)
            grown = _poison(dt, (need, b.size))
            if arr is not None:
                grown[:arr.shape[0]] = arr
            self.arrays[s.buffer] = arr = grown
        return arr

    def _index(self, s: MemorySlice, units: np.ndarray, addr: np.ndarray):
        if s.level == Level.GLOBAL:
            return (addr,)
        row = units // self.graph.parallel.units_per_group if s.level == Level.SHARED else units
        return (row[:, None], addr)

    def _addr(self, s: MemorySlice, units: np.ndarray):
        arr = self.arrays[s.buffer] if s.level == Level.GLOBAL else self._rows(s, units)
        addr = s.addresses(units, self.arrays)
        mask = s.mask(units, self.arrays)
        limit = arr.shape[-1]
        inb = (addr >= 0) & (addr < limit)
        if np.any(mask & ~inb):
            bad = addr[mask & ~inb][0]
            raise IndexError(f"slice {s.describe()} touches element {bad} outside buffer '{s.buffer}' ({limit})")
        return np.where(mask, addr, 0), mask

    def read(self, s: MemorySlice, units: np.ndarray):
        addr, mask = self._addr(s, units)
        return self.arrays[s.buffer][self._index(s, units, addr)], mask

    def write(self, s: MemorySlice, units: np.ndarray, values: np.ndarray, mask: np.ndarray):
        addr, smask = self._addr(s, units)
        mask = mask & smask
        arr = self.arrays[s.buffer]
        values = np.broadcast_to(values, addr.shape).astype(arr.dtype)
        idx = self._index(s, units, addr)
        if s.level == Level.GLOBAL:
            arr[idx[0][mask]] = values[mask]
        else:
            self.dirty.add(s.buffer)
            rows = np.broadcast_to(idx[0], addr.shape)
            arr[rows[mask], addr[mask]] = values[mask]


def _poison(dt: np.dtype, shape) -> np.ndarray:
    """Unwritten elements show: NaN for floats, a sentinel for integers."""
    return np.full(shape, _poison_value(dt), dtype=dt)


def _poison_value(dt: np.dtype):
    if dt.kind == "f" or dt.name == "bfloat16":
        return np.nan
    if dt.kind == "b":
        return False
    return np.iinfo(dt).min // 2 if dt.kind == "i" else np.iinfo(dt).max


def _exec_move(st: _State, op: GOp, units):
    (src,), (dst,) = op.inputs, op.outputs
    vals, m = st.read(src, units)
    fill = np.asarray(src.fill).astype(vals.dtype) if vals.dtype.kind != "b" else bool(src.fill)
    st.write(dst, units, np.where(m, vals, fill), np.ones_like(m))


def _exec_elementwise(st: _State, op: GOp, units):
    fn = scalar_fn(op.args.fn)
    vals = []
    for s in op.inputs:
        v, _ = st.read(s, units)
        vals.append(v.astype(compute_dtype(v.dtype)) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v)
    params = dict(op.args.params)
    if "to" in params:
        params["to"] = np_dtype(str(np.dtype(params["to"])) if not isinstance(params["to"], str) else params["to"])
    with np.errstate(all="ignore"):
        out = fn.numpy(*vals, **{k: params[k] for k in fn.params})
    st.write(op.outputs[0], units, np.asarray(out), np.ones(np.shape(out), dtype=bool))


def _exec_reduce(st: _State, op: GOp, units):
    (src,), (dst,) = op.inputs, op.outputs
    vals, m = st.read(src, units)
    cd = compute_dtype(vals.dtype)
    v = vals.astype(cd).reshape(len(units), src.num, src.width)
    if op.args.fn == "sumexp":
        out = sumexp(v, m.reshape(v.shape), 2 if op.args.over == "width" else 1)
        st.write(dst, units, out.reshape(len(units), -1), np.ones((len(units), dst.count), dtype=bool))
        return
    ident = _IDENTITY[op.args.fn]
    if cd.kind == "b":
        ident = {"sum": False, "prod": True, "max": False, "min": True}[op.args.fn]
    elif cd.kind != "f":
        ident = {"sum": 0, "prod": 1, "max": np.iinfo(cd).min, "min": np.iinfo(cd).max}[op.args.fn]
    v = np.where(m.reshape(v.shape), v, np.asarray(ident).astype(cd))
    axis = 2 if op.args.over == "width" else 1
    out = _REDUCE[op.args.fn](v, axis=axis)
    st.write(dst, units, out.reshape(len(units), -1), np.ones((len(units), dst.count), dtype=bool))


def _exec_broadcast(st: _State, op: GOp, units):
    (src,), (dst,) = op.inputs, op.outputs
    vals, _ = st.read(src, units)
    shape = (len(units), src.num, src.width)
    out = np.broadcast_to(vals.reshape(shape), (len(units), dst.num, dst.width)).reshape(len(units), -1)
    st.write(dst, units, out, np.ones(out.shape, dtype=bool))


def _exec_sync(st: _State, op: GOp, units):
    """A DEVICE sync is a kernel boundary: register and shared data do not survive it."""
    if op.args.scope != Scope.DEVICE:
        return
    # only what the kernel before wrote (the rest still holds its poison): re-poisoning every
    # register buffer of every unit at each boundary took 25 s of a 27 s search (ConvNeXt-T's
    # 768-channel stage, channels-last: 1176 units x 49 x 32 elements a buffer)
    for name in st.dirty:
        arr = st.arrays[name]
        arr.fill(_poison_value(arr.dtype))
    st.dirty.clear()


EXECUTORS = {Move: _exec_move, Elementwise: _exec_elementwise, Reduce: _exec_reduce,
             Broadcast: _exec_broadcast, Sync: _exec_sync}


def run_gir(graph: GIRGraph, feeds: Mapping[str, np.ndarray], shapes: Mapping[str, tuple] | None = None):
    """Execute `graph` on `feeds` (input buffer name -> array); returns output buffer name -> array
    (flat, or reshaped by `shapes`)."""
    st = _State(graph, feeds)
    for op in graph.ops:
        units = op.active_units(graph.parallel.units, st.arrays)
        if len(units) or isinstance(op.args, Sync):
            EXECUTORS[type(op.args)](st, op, units)
    shapes = shapes or {}
    return {n: st.arrays[n].reshape(shapes.get(n, (-1,))) for n in graph.outputs}
