"""GIR: gOperators over memory slices, wrapped in a parallel structure (docs/design.md).

Semantics, precisely (the numpy interpreter in interpreter.py is the reference):

* `Parallel(units, units_per_group, lanes)`: `units` parallel units u = 0..units-1
  (CUDA: warps), grouped by consecutive index into groups of `units_per_group`
  (CUDA: blocks; group = u // units_per_group). A unit has `lanes` lanes.
* Buffers live at a level. GLOBAL buffers are one flat array; SHARED buffers are
  one array per group; REGISTER buffers one array per unit. `size` counts elements
  of that one array.
* A `MemorySlice` is what one unit touches in one buffer: the elements
  `index(u, i, j)` for i < num, j < width (the classic form is
  `offset(u) + i*stride + j`, built by `MemorySlice.strided`). Where `valid(u, i, j)`
  is false the element is not accessed: a move then writes the slice's `fill`
  into the destination, a reduce skips it, a store skips it.
  Element (i, j) belongs to lane `(j // vec) % lanes` of its unit.
* gOperators run for every unit whose `guard(u)` holds, in list order; the list is a
  valid schedule (each unit's program). Slices are matched element by element in
  row-major (i, j) order: a move copies its input's k-th element to its output's
  k-th element, so input and output have the same num * width.
* `Sync(scope)` means "wait" (units within `scope` have finished every earlier
  gOperator) and "the pattern over this data changes here": its inputs are the
  slices as written before it, its outputs the same buffers as read after it.
  DEVICE syncs that remain after rewriting are kernel boundaries.

Nodes are immutable; graphs are rebuilt, never edited in place.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from enum import IntEnum
from typing import Union

import numpy as np

from powerfusion.gir.expr import Expr, I, J, U, const, evaluate, affine_coefficient, loads, variables


class Level(IntEnum):
    REGISTER = 0
    SHARED = 1
    GLOBAL = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Scope(IntEnum):
    LANE = 0
    WARP = 1
    BLOCK = 2
    DEVICE = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def level(self) -> Level:
        """The highest (fastest) level data exchanged at this scope may live in."""
        return {Scope.LANE: Level.REGISTER, Scope.WARP: Level.REGISTER,
                Scope.BLOCK: Level.SHARED, Scope.DEVICE: Level.GLOBAL}[self]


@dataclass(frozen=True, slots=True)
class Parallel:
    units: int
    units_per_group: int = 1
    lanes: int = 32

    @property
    def groups(self) -> int:
        return -(-self.units // self.units_per_group)


@dataclass(frozen=True, slots=True)
class Buffer:
    name: str
    level: Level
    size: int          # elements per instance (see module doc)
    dtype: str         # numpy dtype name: float32, float16, bfloat16, int64, bool, ...


@dataclass(frozen=True, slots=True)
class MemorySlice:
    buffer: str
    level: Level
    index: Expr        # over u, i, j
    num: int
    width: int
    dtype: str
    vec: int = 1       # consecutive elements per lane per access
    valid: Expr | None = None   # over u, i, j; None = all valid
    fill: float = 0.0           # value a move writes where the source is not valid

    @staticmethod
    def strided(buffer: str, level: Level, offset, num: int, width: int, stride: int, dtype: str,
                vec: int = 1, valid: Expr | None = None, fill: float = 0.0) -> "MemorySlice":
        return MemorySlice(buffer, level, const(offset) + I * stride + J, num, width, dtype, vec, valid, fill)

    @property
    def count(self) -> int:
        return self.num * self.width

    @property
    def stride(self) -> int | None:
        """Distance between segments when the index is affine in i (else None)."""
        return affine_coefficient(self.index, "i")

    @property
    def contiguous(self) -> bool:
        return affine_coefficient(self.index, "j") == 1

    def at(self, level: Level, buffer: str | None = None) -> "MemorySlice":
        return replace(self, level=level, buffer=buffer or self.buffer)

    def addresses(self, units: np.ndarray, buffers=None) -> np.ndarray:
        """[len(units), num*width] int64 element indices into the buffer."""
        u, i, j = _grid(units, self.num, self.width)
        return np.broadcast_to(evaluate(self.index, {"u": u, "i": i, "j": j}, buffers),
                               (len(units), self.num, self.width)).reshape(len(units), self.count).astype(np.int64)

    def mask(self, units: np.ndarray, buffers=None) -> np.ndarray:
        if self.valid is None:
            return np.ones((len(units), self.count), dtype=bool)
        u, i, j = _grid(units, self.num, self.width)
        return np.broadcast_to(evaluate(self.valid, {"u": u, "i": i, "j": j}, buffers),
                               (len(units), self.num, self.width)).reshape(len(units), self.count).astype(bool)

    def lanes_of(self, lanes: int) -> np.ndarray:
        """[num*width] lane of each element within its unit."""
        j = np.tile(np.arange(self.width), self.num)
        return (j // self.vec) % lanes

    def pattern(self) -> tuple:
        """Everything but the buffer identity and level: equal patterns are touched identically."""
        return (self.index, self.num, self.width, self.vec, self.valid)

    def describe(self) -> str:
        s = self.stride
        return (f"{self.buffer}@{self.level.label} {self.num}x{self.width}"
                f"{'/' + str(s) if s is not None else ''} {self.dtype}")


def _grid(units: np.ndarray, num: int, width: int):
    return (np.asarray(units, dtype=np.int64)[:, None, None], np.arange(num, dtype=np.int64)[None, :, None],
            np.arange(width, dtype=np.int64)[None, None, :])


# ---- gOperator kinds: each kind's arguments in one small frozen dataclass ----------------

@dataclass(frozen=True, slots=True)
class Elementwise:
    """out(i,j) = fn(in0(i,j), in1(i,j), ...): fn from powerfusion.scalar.SCALAR_FNS."""
    fn: str
    params: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True, slots=True)
class Reduce:
    """Reduce the input (num x width) over 'width' (-> num x 1) or 'num' (-> 1 x width).
    Over width across lanes this includes the lanes' exchange (a WARP-scope step)."""
    fn: str      # sum | max | min | prod | sumexp
    over: str    # "width" | "num"
    # sumexp: sum over the elements of exp(x - max), an element equal to the max counting 1 (a
    # per-slot softmax denominator, one pass with a running max: rewrite/onepass.py); it is
    # not combinable with itself, so only over num, and only on floats


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Input num x 1 (over='width') or 1 x width (over='num') repeated to the output's shape."""
    over: str


@dataclass(frozen=True, slots=True)
class Move:
    """Copy input slice to output slice element by element (levels and patterns may differ)."""


@dataclass(frozen=True, slots=True)
class Sync:
    scope: Scope


GOpArgs = Union[Elementwise, Reduce, Broadcast, Move, Sync]
KIND_OF = {Elementwise: "elementwise", Reduce: "reduce", Broadcast: "broadcast", Move: "move", Sync: "sync"}
COMPUTE_KINDS = frozenset({"elementwise", "reduce", "broadcast"})
MOVEMENT_KINDS = frozenset({"move", "sync"})


@dataclass(frozen=True, slots=True)
class GOp:
    args: GOpArgs
    inputs: tuple[MemorySlice, ...]
    outputs: tuple[MemorySlice, ...]
    guard: Expr | None = None    # over u; None = every unit
    origin: str = ""             # the basic op (or rule) it came from, for reports and the visualiser
    uid: int = field(default=0, compare=False)  # stable identity for traces; not part of equality

    @property
    def kind(self) -> str:
        return KIND_OF[type(self.args)]

    def active_units(self, units: int, buffers=None) -> np.ndarray:
        """The units that run this gOperator (sorted; read-only: shared between callers)."""
        if buffers is None or self.guard is None or not _guard_loads(self.guard):
            return _active_units(self.guard, units)
        u = _unit_range(units)
        return u[np.broadcast_to(evaluate(self.guard, {"u": u}, buffers), u.shape).astype(bool)]

    def describe(self) -> str:
        a = self.args
        head = {Elementwise: lambda: f"elementwise({a.fn})", Reduce: lambda: f"reduce({a.fn}, {a.over})",
                Broadcast: lambda: f"broadcast({a.over})", Move: lambda: "move",
                Sync: lambda: f"sync({a.scope.label})"}[type(a)]()
        return f"{head} [{', '.join(s.describe() for s in self.inputs)}] -> [{', '.join(s.describe() for s in self.outputs)}]"


@dataclass(frozen=True)
class GIRGraph:
    """One memory-bound subgraph as GIR: buffers, a parallel structure, a schedule of gOperators.

    `inputs`/`outputs` name the GLOBAL buffers exchanged with the rest of the model;
    `constants` hold data for GLOBAL buffers known at compile time."""
    name: str
    parallel: Parallel
    buffers: tuple[Buffer, ...]
    ops: tuple[GOp, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    constants: tuple[tuple[str, np.ndarray], ...] = ()
    templates: tuple[tuple[str, str], ...] = ()  # (basic node name, template chosen) for reports

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"GIR graph {self.name} has no buffer '{name}'")

    def with_ops(self, ops, buffers=None) -> "GIRGraph":
        """A new graph with these ops; unused non-interface buffers are dropped."""
        ops = tuple(ops)
        keep = set(self.inputs) | set(self.outputs) | {n for n, _ in self.constants}
        for op in ops:
            for s in op.inputs + op.outputs:
                keep.add(s.buffer)
                keep.update(_loaded(s))
        bufs = tuple(b for b in (buffers if buffers is not None else self.buffers) if b.name in keep)
        return replace(self, ops=ops, buffers=bufs)

    def to_networkx(self):
        """Dataflow view: op index -> op index when a later op reads a buffer an earlier op wrote
        (edge attribute `slice`: the reader's input slice)."""
        import networkx as nx
        g = nx.MultiDiGraph()
        last_writer: dict[str, int] = {}
        for k, op in enumerate(self.ops):
            g.add_node(k, op=op)
            for s in op.inputs:
                if s.buffer in last_writer:
                    g.add_edge(last_writer[s.buffer], k, slice=s)
            for s in op.outputs:
                last_writer[s.buffer] = k
        return g

    def kernels(self) -> list[tuple[GOp, ...]]:
        """The schedule split at DEVICE syncs (each part is one kernel)."""
        parts, cur = [], []
        for op in self.ops:
            if isinstance(op.args, Sync) and op.args.scope == Scope.DEVICE:
                if cur:
                    parts.append(tuple(cur))
                cur = []
            else:
                cur.append(op)
        if cur:
            parts.append(tuple(cur))
        return parts


def unnamed(s: MemorySlice) -> MemorySlice:
    """`s` with its buffer's name left out: the memo key of a question whose answer does not
    depend on which buffer the slices touch (sync scope, writer coordinates, injectivity, a
    refit). The same exchange recurs in plan after plan of a search under other buffer names
    (a promoted intermediate's fresh name, another template's temporaries): keyed by name,
    Swin-T's searches met two thirds of those questions as new."""
    return replace(s, buffer="")


def units_key(units) -> tuple:
    """A compact exact-in-practice key for a unit array in memo tables: its length, ends and a
    128-bit digest of its contents (the arrays run to millions of ids; keys must stay small).
    The shared read-only arrays (`GOp.active_units`) are hashed once each, by identity: the
    rewriter and the search ask about the same few arrays thousands of times, and hashing
    them again each time made build time grow with tensor size."""
    if isinstance(units, np.ndarray) and not units.flags.writeable and units.base is None:
        hit = _KEYS_BY_ID.get(id(units))
        if hit is not None and hit[0] is units:
            return hit[1]
        key = _digest(units)
        if len(_KEYS_BY_ID) >= 4096:
            _KEYS_BY_ID.clear()
        _KEYS_BY_ID[id(units)] = (units, key)   # the array is held, so its id is not reused
        return key
    return _digest(units)


def _digest(units) -> tuple:
    a = np.asarray(units, dtype=np.int64, order="C")
    if a.size == 0:
        return (0,)
    return (a.size, int(a[0]), int(a[-1]), hashlib.blake2b(a.data, digest_size=16).digest())


_KEYS_BY_ID: dict[int, tuple] = {}


def is_sorted(units: np.ndarray) -> bool:
    return units.size < 2 or bool(units[0] <= units[-1] and np.all(units[1:] >= units[:-1]))


def sorted_once(units: np.ndarray) -> bool:
    """is_sorted, remembered by identity for the shared read-only arrays (as units_key)."""
    if units.flags.writeable or units.base is not None:
        return is_sorted(units)
    hit = _SORTED_BY_ID.get(id(units))
    if hit is None or hit[0] is not units:
        if len(_SORTED_BY_ID) >= 4096:
            _SORTED_BY_ID.clear()
        hit = _SORTED_BY_ID[id(units)] = (units, is_sorted(units))
    return hit[1]


_SORTED_BY_ID: dict[int, tuple] = {}


def _range_once(units: np.ndarray) -> bool:
    """`units` are consecutive ids lo, lo+1, ..., hi, remembered by identity for the shared
    read-only arrays; other arrays are not checked (False: the caller searches)."""
    if units.flags.writeable or units.base is not None or units.ndim != 1:
        return False
    hit = _RANGE_BY_ID.get(id(units))
    if hit is None or hit[0] is not units:
        if len(_RANGE_BY_ID) >= 4096:
            _RANGE_BY_ID.clear()
        run = units.size > 0 and int(units[-1]) - int(units[0]) + 1 == units.size and bool(np.all(np.diff(units) == 1))
        hit = _RANGE_BY_ID[id(units)] = (units, run)
    return hit[1]


_RANGE_BY_ID: dict[int, tuple] = {}


def member_mask(values: np.ndarray, units: np.ndarray) -> np.ndarray:
    """np.isin(values, units) by binary search when `units` is sorted (active units are): the
    cost follows the (sampled) values, not the millions of units."""
    units = np.asarray(units)
    if units.size == 0:
        return np.zeros(np.shape(values), bool)
    if _range_once(units):   # 0..n-1 or any run of consecutive ids: two comparisons, no search
        return (values >= units[0]) & (values <= units[-1])
    if sorted_once(units):
        at = np.minimum(np.searchsorted(units, values), units.size - 1)
        return units[at] == values
    return np.isin(values, units)   # id(read-only array) -> (the array, its key)


@lru_cache(maxsize=16)
def _unit_range(units: int) -> np.ndarray:
    u = np.arange(units, dtype=np.int64)
    u.flags.writeable = False
    # its key without hashing it: 0..units-1 (a CPU plan can have a hundred million units)
    _KEYS_BY_ID[id(u)] = (u, _range_key(units))
    _SORTED_BY_ID[id(u)] = (u, True)
    return u


def _range_key(units: int) -> tuple:
    return (0,) if units == 0 else (units, 0, units - 1, b"range")


@lru_cache(maxsize=64)
def _active_units(guard: Expr | None, units: int) -> np.ndarray:
    u = _unit_range(units)
    if guard is None:
        return u
    out = u[np.broadcast_to(evaluate(guard, {"u": u}), u.shape).astype(bool)]
    out.flags.writeable = False
    return out


def _guard_loads(guard: Expr) -> bool:
    return bool(loads(guard))


def _loaded(s: MemorySlice) -> frozenset[str]:
    from powerfusion.gir.expr import loads
    out = loads(s.index)
    if s.valid is not None:
        out |= loads(s.valid)
    return out
