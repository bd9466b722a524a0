"""A fast CPU executor of GIR graphs, with the numpy interpreter's semantics (interpreter.py).

    program = FastProgram(graph)          # once: every slice's addresses analysed
    outputs = program.run(feeds)          # many times

Like the interpreter, each gOperator runs over all its active units at once, in program
order, on arrays shaped [units, num, width]. Lockstep over all units is a valid schedule of
any program whose syncs are placed right: a WARP or BLOCK barrier only waits for earlier
gOperators of units in the same warp or block, and in lockstep every unit has finished every
earlier gOperator before the next one starts, so those syncs are no-ops. A DEVICE sync is a
kernel boundary: register and shared data are dropped there (the next reader sees poison,
as in the interpreter).

What makes it fast is that the addressing is analysed once, not per run:

* Every buffer is one flat array (register buffers: unit-major rows of `size`, shared:
  group-major rows). A slice over the active units is a map (unit position, i, j) -> flat
  index. Where that map is affine -- almost every template's is -- the access is a strided
  view (no index array at all); elsewhere an index array is kept (int32 where it fits),
  within a memory budget.
* Masked-off elements of an affine access may lie just outside the buffer (a tail, a pad
  border): buffers get that much padding so the view stays inside memory; the mask decides.
* Slices whose addresses or guards load data (gather indices), and accesses beyond the
  budget, are evaluated at run time, in chunks of whole groups of units.

Reads come back C-contiguous and reductions run on the same layout as the interpreter's, so
the numbers are the interpreter's bit for bit (tests/gir/test_fastexec.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import numpy as np

from powerfusion.gir.expr import loads
from powerfusion.gir.interpreter import _IDENTITY, _REDUCE, _poison, compute_dtype, np_dtype, sumexp
from powerfusion.gir.ir import Broadcast, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Reduce, Scope, Sync
from powerfusion.scalar import scalar_fn

INDEX_BUDGET_BYTES = 256 << 20   # index arrays and masks kept per program; beyond: computed per run
CHUNK_ELEMENTS = 1 << 22         # elements per chunk when an access is computed at run time
MAX_PAD = 1 << 16                # padding (elements) a buffer may get so masked affine views stay in memory


@dataclass(frozen=True, slots=True)
class _Affine:
    """Flat index of element (p, i, j) = offset + p*su + i*si + j*sj (p: position among active units)."""
    offset: int
    strides: tuple[int, int, int]
    injective: bool


@dataclass(frozen=True, slots=True)
class _Access:
    slice: MemorySlice
    affine: _Affine | None       # None: `index` holds the flat indices, or both None: computed per run
    index: np.ndarray | None     # [U, num, width] flat indices (masked-off elements: the row's element 0)
    mask: np.ndarray | None      # [U, num, width] bool; None: every element valid
    base: np.ndarray | None = None  # [U, 1, 1] flat index of each unit's element 0 (kept with a mask)

    @property
    def dynamic(self) -> bool:
        return self.affine is None and self.index is None


@dataclass(frozen=True, slots=True)
class _Step:
    op: GOp
    units: np.ndarray | None     # active units; None: the guard loads data (evaluated per run)
    inputs: tuple[_Access, ...]
    outputs: tuple[_Access, ...]
    dynamic: bool = False        # some access (or the guard) is evaluated per run


def _step(op, units, inputs, outputs) -> _Step:
    return _Step(op, units, inputs, outputs, units is None or any(a.dynamic for a in inputs + outputs))


def _rows(graph: GIRGraph) -> dict[str, int]:
    """Instances of each buffer: one GLOBAL; a REGISTER (SHARED) buffer one per unit (group) up to
    the last unit that touches it -- a template that runs on few units of a wide merged graph
    keeps few rows (a whole-tensor register tile on one unit was once allocated for every unit
    of the graph: 8.9 GiB for a Relu before a MaxPool of 1x8x111x111)."""
    P = graph.parallel
    rows = {b.name: 1 if b.level == Level.GLOBAL else 0 for b in graph.buffers}
    for op in graph.ops:
        if isinstance(op.args, Sync):
            continue
        dynamic = op.guard is not None and bool(loads(op.guard))
        units = None if dynamic else op.active_units(P.units)
        last = P.units - 1 if units is None else (int(units[-1]) if len(units) else -1)
        for s in op.inputs + op.outputs:
            if s.level == Level.REGISTER:
                rows[s.buffer] = max(rows[s.buffer], last + 1)
            elif s.level == Level.SHARED:
                rows[s.buffer] = max(rows[s.buffer], last // P.units_per_group + 1)
    return {name: max(r, 1) for name, r in rows.items()}


class FastProgram:
    """`graph` prepared for repeated execution; `run(feeds)` gives what `run_gir` gives."""

    def __init__(self, graph: GIRGraph, index_budget: int = INDEX_BUDGET_BYTES, chunk_elements: int = CHUNK_ELEMENTS):
        self.graph = graph
        self.chunk_elements = chunk_elements
        P = graph.parallel
        self.rows = _rows(graph)
        self.sizes = {b.name: b.size for b in graph.buffers}
        self.dtypes = {b.name: np_dtype(b.dtype) for b in graph.buffers}
        self.global_names = {b.name for b in graph.buffers if b.level == Level.GLOBAL}
        self.pad: dict[str, list[int]] = {b.name: [0, 0] for b in graph.buffers}
        self._budget = index_budget
        self.steps = tuple(self._prepare(op) for op in graph.ops)
        self.written = {a.slice.buffer for s in self.steps for a in s.outputs}
        self.index_bytes = index_budget - self._budget
        self.poisoned = self._poison_needed()

    # ---- preparation ----------------------------------------------------------------

    def _prepare(self, op: GOp) -> _Step:
        if isinstance(op.args, Sync):
            return _step(op, np.zeros(0, np.int64), (), ())
        dyn_guard = op.guard is not None and bool(loads(op.guard))
        units = None if dyn_guard else op.active_units(self.graph.parallel.units)
        prep = (lambda s: _Access(s, None, None, None)) if units is None else (lambda s: self._access(s, units))
        return _step(op, units, tuple(prep(s) for s in op.inputs), tuple(prep(s) for s in op.outputs))

    def _access(self, s: MemorySlice, units: np.ndarray) -> _Access:
        dynamic = _Access(s, None, None, None)
        if loads(s.index) or (s.valid is not None and loads(s.valid)) or len(units) == 0:
            return dynamic
        if len(units) * s.count > self.chunk_elements:  # analysed chunk by chunk, only as a plain view
            aff = self._fit_in_chunks(s, units)
            return dynamic if aff is None else _Access(s, aff, None, None)
        flat, mask, base = self._flat(s, units)   # raises IndexError as the interpreter does
        total = self.rows[s.buffer] * self.sizes[s.buffer]
        if mask is not None and mask.all():
            mask = None
        base = None if mask is None else base
        aff = _fit_affine(flat)
        if aff is not None:
            lo, hi = _extent(aff, flat.shape)
            pad = self.pad[s.buffer]
            need_lo, need_hi = max(0, -lo), max(0, hi + 1 - total)
            if max(need_lo, need_hi) <= MAX_PAD and (mask is not None or (need_lo == need_hi == 0)):
                cost = 0 if mask is None else mask.nbytes
                if cost <= self._budget:
                    self._budget -= cost
                    pad[0], pad[1] = max(pad[0], need_lo), max(pad[1], need_hi)
                    return _Access(s, aff, None, mask, base)
        index = np.where(mask, flat, base) if mask is not None else flat
        index = index.astype(np.int32 if total < 2**31 else np.int64)
        cost = index.nbytes + (0 if mask is None else mask.nbytes)
        if cost > self._budget:
            return dynamic
        self._budget -= cost
        return _Access(s, None, index, mask, base)

    def _fit_in_chunks(self, s: MemorySlice, units: np.ndarray) -> _Affine | None:
        """An unmasked affine access, checked in chunks of units so memory stays bounded."""
        step = max(2, self.chunk_elements // max(s.count, 1))
        first = None
        for start in range(0, len(units), step):
            flat, mask, _ = self._flat(s, units[start:start + step])
            if mask is not None and not mask.all():
                return None
            if first is None:
                first = _fit_affine(flat)
                if first is None:
                    return None
            o, (su, si, sj) = first.offset + start * first.strides[0], first.strides
            p, i, j = _grid(flat.shape)
            if not np.array_equal(flat, o + p * su + i * si + j * sj):
                return None
        return _Affine(first.offset, first.strides, _injective(first.strides, (len(units), s.num, s.width)))

    def _flat(self, s: MemorySlice, units: np.ndarray, globals_=None):
        """[U, num, width] flat indices (row base + address), the valid mask (None: all valid) and
        [U, 1, 1] row bases (where the interpreter reads a masked-off element)."""
        addr = s.addresses(units, globals_).reshape(len(units), s.num, s.width)
        mask = None if s.valid is None else s.mask(units, globals_).reshape(addr.shape)
        size = self.sizes[s.buffer]
        bad = (addr < 0) | (addr >= size)
        if mask is not None:
            bad &= mask
        if bad.any():
            raise IndexError(f"slice {s.describe()} touches element {addr[bad][0]} outside buffer '{s.buffer}' "
                             f"({size})")
        base = np.zeros((len(units), 1, 1), np.int64)
        if s.level != Level.GLOBAL:
            row = units // self.graph.parallel.units_per_group if s.level == Level.SHARED else units
            base = (row * size)[:, None, None]
            addr = addr + base
        return addr, mask, base

    def _poison_needed(self) -> set[str]:
        """Buffers whose unwritten elements could be observed: a read of an element not written
        before it (in the same kernel for register and shared data), or a graph output not
        written everywhere. Only these are filled with poison; the rest start uninitialised,
        which saves touching every unit's registers when few units are active."""
        covered: dict[str, np.ndarray] = {}
        needs = {b.name for b in self.graph.buffers if b.level != Level.GLOBAL and self._too_big(b.name)}
        for step in self.steps:
            if isinstance(step.op.args, Sync):
                if step.op.args.scope == Scope.DEVICE:
                    for b in [b for b in covered if b not in self.global_names]:
                        del covered[b]
                continue
            unknown = step.dynamic or len(step.units) * max(a.slice.count for a in step.inputs + step.outputs) \
                > self.chunk_elements   # not analysed: reads need poison, writes cover nothing
            for a in step.inputs:
                name = a.slice.buffer
                cov = covered.get(name)
                if cov is None or unknown or not cov[_touched(a, len(step.units), read=True)].all():
                    needs.add(name)
            for a in step.outputs:
                name = a.slice.buffer
                if unknown or name in needs:
                    continue
                if name not in covered:
                    covered[name] = np.zeros(self.rows[name] * self.sizes[name], bool)
                covered[name][_touched(a, len(step.units), read=False)] = True
        for name in self.graph.outputs:
            if name not in covered or not covered[name].all():
                needs.add(name)
        return needs

    def _too_big(self, name: str) -> bool:
        return self.rows[name] * self.sizes[name] > 8 * self.chunk_elements

    # ---- execution ------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray], shapes: Mapping[str, tuple] | None = None) -> dict:
        st = _Run(self, feeds)
        for step in self.steps:
            if isinstance(step.op.args, Sync):
                if step.op.args.scope == Scope.DEVICE:
                    st.end_kernel()
                continue
            if step.dynamic:
                self._run_dynamic(st, step)
            elif len(step.units):
                EXECUTORS[type(step.op.args)](st, step, step.units)
        shapes = shapes or {}
        return {n: st.result(n).reshape(shapes.get(n, (-1,))) for n in self.graph.outputs}

    def _run_dynamic(self, st: "_Run", step: _Step) -> None:
        """Accesses computed now, for chunks of whole groups (units in a group share memory)."""
        units = step.units if step.units is not None else step.op.active_units(self.graph.parallel.units, st.globals)
        if not len(units):
            return
        per_unit = max([a.slice.count for a in step.inputs + step.outputs] + [1])
        upg = self.graph.parallel.units_per_group
        reads = {a.slice.buffer for a in step.inputs}
        in_place = any(a.slice.buffer in reads for a in step.outputs)
        chunks = [units]
        if not in_place and len(units) * per_unit > self.chunk_elements:
            groups = units // upg
            per_chunk = max(1, self.chunk_elements // (per_unit * upg))
            cuts = np.flatnonzero(np.diff(groups // per_chunk)) + 1
            chunks = np.split(units, cuts)
        for part in chunks:
            resolved = _Step(step.op, part, tuple(self._resolve(a, part, st) for a in step.inputs),
                             tuple(self._resolve(a, part, st) for a in step.outputs))
            EXECUTORS[type(step.op.args)](st, resolved, part)

    def _resolve(self, a: _Access, units: np.ndarray, st: "_Run") -> _Access:
        flat, mask, base = self._flat(a.slice, units, st.globals)
        return _Access(a.slice, None, np.where(mask, flat, base) if mask is not None else flat, mask, base)


def _fit_affine(flat: np.ndarray) -> _Affine | None:
    U, N, W = flat.shape
    o = int(flat[0, 0, 0])
    su = int(flat[1, 0, 0]) - o if U > 1 else 0
    si = int(flat[0, 1, 0]) - o if N > 1 else 0
    sj = int(flat[0, 0, 1]) - o if W > 1 else 0
    p, i, j = _grid(flat.shape)
    if not np.array_equal(flat, o + p * su + i * si + j * sj):
        return None
    return _Affine(o, (su, si, sj), _injective((su, si, sj), flat.shape))


def _touched(a: _Access, count: int, read: bool) -> np.ndarray:
    """Flat indices an access touches (a masked read also reads each unit's element 0)."""
    if a.affine is not None:
        o, (su, si, sj) = a.affine.offset, a.affine.strides
        p, i, j = _grid((count, a.slice.num, a.slice.width))
        index = np.broadcast_to(o + p * su + i * si + j * sj, (count, a.slice.num, a.slice.width))
    else:
        index = a.index
    if a.mask is None:
        return index.reshape(-1)
    out = index[a.mask]
    return np.concatenate([out, a.base.reshape(-1)]) if read else out


def _grid(shape):
    """Open index grids (p, i, j) for a [U, num, width] block (np.ogrid without its overhead)."""
    U, N, W = shape
    return (np.arange(U, dtype=np.int64)[:, None, None], np.arange(N, dtype=np.int64)[None, :, None],
            np.arange(W, dtype=np.int64)[None, None, :])


def _injective(strides, shape) -> bool:
    """Sufficient: sorted by |stride|, each stride steps over the whole span of the smaller ones."""
    span = 0
    for s, n in sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1):
        if s <= span:
            return False
        span += s * (n - 1)
    return True


def _extent(a: _Affine, shape) -> tuple[int, int]:
    lo = hi = a.offset
    for s, n in zip(a.strides, shape):
        lo, hi = lo + min(0, s * (n - 1)), hi + max(0, s * (n - 1))
    return lo, hi


class _Run:
    """The arrays of one run: padded flat buffers; register and shared ones made on first use."""

    def __init__(self, prog: FastProgram, feeds: Mapping[str, np.ndarray]):
        self.prog = prog
        self.flat: dict[str, np.ndarray] = {}    # padded storage
        self.globals: dict[str, np.ndarray] = {} # unpadded views of the GLOBAL buffers (for Load)
        consts = dict(prog.graph.constants)
        for b in prog.graph.buffers:
            if b.level != Level.GLOBAL:
                continue
            src = feeds.get(b.name, consts.get(b.name))
            dt = prog.dtypes[b.name]
            lo, hi = prog.pad[b.name]
            if src is None:
                self._alloc(b.name)
                continue
            a = np.asarray(src).astype(dt, copy=False).reshape(-1)
            if a.size != b.size:
                raise ValueError(f"buffer '{b.name}' holds {b.size} elements, fed {a.size}")
            if lo or hi or b.name in prog.written or not a.flags.c_contiguous:
                store = _poison(dt, lo + b.size + hi)
                store[lo:lo + b.size] = a
                a = store
            self.flat[b.name] = a
            self.globals[b.name] = a[lo:lo + b.size]

    def _alloc(self, name: str) -> np.ndarray:
        prog = self.prog
        lo, hi = prog.pad[name]
        n = prog.rows[name] * prog.sizes[name]
        dt = prog.dtypes[name]
        store = _poison(dt, lo + n + hi) if name in prog.poisoned else np.empty(lo + n + hi, dt)
        self.flat[name] = store
        if name in prog.global_names:
            self.globals[name] = store[lo:lo + n]
        return store

    def storage(self, name: str) -> np.ndarray:
        a = self.flat.get(name)
        return a if a is not None else self._alloc(name)

    def end_kernel(self) -> None:
        """Register and shared data do not survive a kernel boundary."""
        for b in self.prog.graph.buffers:
            if b.level != Level.GLOBAL:
                self.flat.pop(b.name, None)

    def result(self, name: str) -> np.ndarray:
        out = self.globals[name]
        return out if name in self.prog.written else out.copy()  # never the caller's own feed

    def read(self, a: _Access, count: int):
        """Values [U, num, width] (C-contiguous) and the valid mask (None: all valid). As in the
        interpreter, a masked-off element reads as the unit's element 0 of the buffer."""
        store = self.storage(a.slice.buffer)
        shape = (count, a.slice.num, a.slice.width)
        lo = self.prog.pad[a.slice.buffer][0]
        if a.affine is None:
            return store[a.index + lo], a.mask
        vals = self._view(store, a, shape)
        if a.mask is not None:
            return np.where(a.mask, vals, store[a.base + lo]), a.mask
        return np.asarray(vals, order="C"), None

    def write(self, a: _Access, values: np.ndarray, count: int) -> None:
        store = self.storage(a.slice.buffer)
        shape = (count, a.slice.num, a.slice.width)
        if values.shape != shape:  # the k-th element goes to the k-th place, whatever the tile shapes
            values = values.reshape(shape) if values.size == count * a.slice.count else np.broadcast_to(values, shape)
        values = values.astype(store.dtype, copy=False)
        lo = self.prog.pad[a.slice.buffer][0]
        if a.affine is not None and a.affine.injective:
            view = self._view(store, a, shape)
            if a.mask is None:
                view[...] = values
            else:
                np.copyto(view, values, where=a.mask)
            return
        if a.affine is not None:  # repeated addresses: the last write (row-major order) wins, as in run_gir
            o, (su, si, sj) = a.affine.offset, a.affine.strides
            p, i, j = _grid(shape)
            index = o + p * su + i * si + j * sj
        else:
            index = a.index
        if a.mask is None:
            store[index.reshape(-1) + lo] = values.reshape(-1)
        else:
            store[index[a.mask] + lo] = values[a.mask]

    def _view(self, store: np.ndarray, a: _Access, shape) -> np.ndarray:
        """The affine access as a strided view (numpy checks it stays inside the storage)."""
        lo, item = self.prog.pad[a.slice.buffer][0], store.itemsize
        return np.ndarray(shape, store.dtype, buffer=store, offset=(lo + a.affine.offset) * item,
                          strides=tuple(s * item for s in a.affine.strides))


# ---- gOperators: the interpreter's arithmetic on [U, num, width] arrays -------------------

def _exec_move(st: _Run, step: _Step, units) -> None:
    (src,), (dst,) = step.inputs, step.outputs
    vals, m = st.read(src, len(units))
    if m is not None:
        fill = np.asarray(src.slice.fill).astype(vals.dtype) if vals.dtype.kind != "b" else bool(src.slice.fill)
        vals = np.where(m, vals, fill)
    st.write(dst, vals, len(units))


def _exec_elementwise(st: _Run, step: _Step, units) -> None:
    fn = scalar_fn(step.op.args.fn)
    vals = []
    for a in step.inputs:
        v, _ = st.read(a, len(units))
        v = v.reshape(len(units), -1)   # matched element by element: tile shapes may differ
        vals.append(v.astype(_wide(v.dtype), copy=False))
    params = dict(step.op.args.params)
    if "to" in params:
        params["to"] = np_dtype(str(np.dtype(params["to"])) if not isinstance(params["to"], str) else params["to"])
    with np.errstate(all="ignore"):
        out = fn.numpy(*vals, **{k: params[k] for k in fn.params})
    st.write(step.outputs[0], np.asarray(out), len(units))


def _exec_reduce(st: _Run, step: _Step, units) -> None:
    (src,), (dst,) = step.inputs, step.outputs
    vals, m = st.read(src, len(units))
    cd = _wide(vals.dtype)
    v = vals.astype(cd, copy=False)
    fn = step.op.args.fn
    if fn == "sumexp":
        out = sumexp(v, m, 2 if step.op.args.over == "width" else 1)
        st.write(dst, out.reshape(len(units), dst.slice.num, dst.slice.width), len(units))
        return
    if m is not None:
        ident = _IDENTITY[fn] if cd.kind == "f" else \
            {"sum": 0, "prod": 1, "max": np.iinfo(cd).min, "min": np.iinfo(cd).max}[fn]
        v = np.where(m, v, np.asarray(ident).astype(cd))
    out = _REDUCE[fn](v, axis=2 if step.op.args.over == "width" else 1)
    st.write(dst, out.reshape(len(units), dst.slice.num, dst.slice.width), len(units))


def _exec_broadcast(st: _Run, step: _Step, units) -> None:
    (src,), (dst,) = step.inputs, step.outputs
    vals, _ = st.read(src, len(units))
    st.write(dst, np.broadcast_to(vals, (len(units), dst.slice.num, dst.slice.width)), len(units))


@lru_cache(maxsize=None)
def _wide(dt: np.dtype) -> np.dtype:
    """The interpreter's compute dtype: fp16/bf16 arithmetic in fp32."""
    return compute_dtype(dt)


EXECUTORS = {Move: _exec_move, Elementwise: _exec_elementwise, Reduce: _exec_reduce, Broadcast: _exec_broadcast}


def run_fast(graph: GIRGraph, feeds: Mapping[str, np.ndarray], shapes: Mapping[str, tuple] | None = None) -> dict:
    """One-shot `FastProgram(graph).run(feeds, shapes)`: a drop-in for interpreter.run_gir."""
    return FastProgram(graph).run(feeds, shapes)
