"""Shared machinery of the templates: candidates, naming, iteration spaces and slices.

A template walks an *iteration space* (a shape; usually the output's) and reads or
writes tensors through affine *views* of it (`View`: a linear combination of the space
coordinates plus a base, in elements of the tensor's flat layout). A *tiling* assigns
the space to units: it splits the space's dimensions into consecutive pieces, each
indexed by one flat expression of (u, i, j) -- e.g. rows: the leading dims by `u`, the
trailing dims by `i*W + j`. Index expressions are built the same way everywhere, so
two templates that touch a tensor identically produce structurally equal slices.
"""
from __future__ import annotations

from powerfusion import names as _names
from powerfusion.names import sanitize  # noqa: F401  (one rule for every identifier)

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from powerfusion.errors import NodeError
from powerfusion.basic import BasicNode, TensorInfo
from powerfusion.gir.expr import Expr, I, J, U, const, emax, emin, select
from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Parallel
from powerfusion.targets.specs import TargetSpec, get_target

UNITS_PER_GROUP = 4  # one group size for every template, so that merged templates share it


def buffer_names(tensors: Sequence[str], taken: set[str] | None = None, reserved: str = "") -> dict[str, str]:
    """Tensor name -> unique sanitised buffer name (one scheme: powerfusion.names)."""
    return _names.buffer_names(tensors, reserved, taken or ())


def dtype_name(dt) -> str:
    return np.dtype(dt).name


def reg_dtype(dt) -> str:
    """Registers hold fp16/bf16 data as float32 (loads widen, stores narrow)."""
    name = dtype_name(dt)
    return "float32" if name in ("float16", "bfloat16") else name


def vec_options(dt, extent: int) -> list[int]:
    """Vector widths for a lane access of <= 16 bytes that divide the contiguous extent, widest first."""
    size = np.dtype(dt).itemsize
    return [v for v in (8, 4, 2, 1) if v * size <= 16 and extent % v == 0]


@dataclass(frozen=True)
class Ctx:
    """What a template builder knows: the node, tensor infos, target, naming."""
    node: BasicNode
    tensors: dict
    target: TargetSpec
    names: dict                 # tensor -> GLOBAL buffer name
    prefix: str = ""            # e.g. the subgraph name, for register/shared buffer names

    @property
    def lanes(self) -> int:
        return self.target.lanes

    @property
    def upg(self) -> int:
        return max(1, min(UNITS_PER_GROUP, self.target.units_per_group_max))

    def info(self, k: int, out: bool = False) -> TensorInfo:
        return self.tensors[(self.node.outputs if out else self.node.inputs)[k]]

    def error(self, message: str) -> NodeError:
        o = self.node.origin
        shapes = [tuple(self.tensors[t].shape) for t in self.node.inputs]
        return NodeError(o.node, o.op_type, o.opset, shapes, f"(basic op {self.node.name}) {message}")


@dataclass(frozen=True)
class Candidate:
    """One template with one parameter point for one basic node; `build()` gives its GIR graph."""
    name: str                 # template name, e.g. "reduce.row_warp"
    params: object            # the template's frozen parameter dataclass
    ctx: Ctx = field(repr=False, compare=False)
    builder: Callable = field(repr=False, compare=False)

    def build(self) -> GIRGraph:
        return self.graph

    @cached_property
    def graph(self) -> GIRGraph:
        return self.builder(self.ctx, self.params)

    @property
    def node(self) -> BasicNode:
        return self.ctx.node

    @property
    def label(self) -> str:
        return f"{self.name}{_fmt_params(self.params)}"


def _fmt_params(p) -> str:
    if p is None:
        return ""
    items = [f"{k}={getattr(p, k)}" for k in getattr(p, "__dataclass_fields__", {})]
    return "(" + ", ".join(items) + ")"


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def prod(xs) -> int:
    return int(np.prod(xs, dtype=np.int64)) if len(xs) else 1


# ---- spaces, views, tilings -----------------------------------------------------------

@dataclass(frozen=True)
class View:
    """tensor element = base + sum(lin[e] * x[e]) over the space coordinates x."""
    lin: tuple[int, ...]
    base: int = 0


def contiguous_view(shape) -> View:
    return View(contiguous_strides(shape))


Piece = tuple[Expr, tuple[int, ...]]  # (flat expression, space dims it indexes, in order)


def coords(pieces: Sequence[Piece], shape) -> list[Expr]:
    """Per-dimension coordinate expressions of the space under a tiling (no merging)."""
    out: list[Expr | None] = [None] * len(shape)
    for flat, dims in pieces:
        acc = 1
        for pos in range(len(dims) - 1, -1, -1):
            d = dims[pos]
            e = flat // acc if acc != 1 else flat
            out[d] = e % shape[d] if pos else e  # the first dim needs no modulo (flat < extent)
            acc *= shape[d]
    return [c if c is not None else const(0) for c in out]


def view_index(view: View, pieces: Sequence[Piece], shape) -> Expr:
    """The index expression of a view under a tiling, merging adjacent dims of a piece that the
    view walks contiguously (so a row-major walk yields `base + flat`, not a chain of // and %)."""
    total: Expr = const(view.base)
    for flat, dims in pieces:
        groups: list[list[int]] = []  # merged runs: (extent, stride)
        for d in dims:
            if shape[d] == 1:
                continue
            ext, st = shape[d], view.lin[d]
            if groups and groups[-1][1] == st * ext:
                groups[-1] = [groups[-1][0] * ext, st]
            else:
                groups.append([ext, st])
        acc = 1
        for pos in range(len(groups) - 1, -1, -1):
            ext, st = groups[pos]
            if st != 0:
                e = flat // acc if acc != 1 else flat
                if pos:
                    e = e % ext
                total = total + e * st
            acc *= ext
    return total


def rows_tiling(shape, split: int, W: int, per_row: int = 1) -> tuple[list[Piece], int, int, Expr | None]:
    """`per_row` consecutive units per row (one unit: per_row = 1): leading dims [:split] by
    u // per_row, the row [split:] in segments of W dealt round-robin to the row's units
    (segment i of unit u is segment i*per_row + u % per_row: reduce.block's layout).
    Returns (pieces, units, num, valid)."""
    R, C = prod(shape[:split]), prod(shape[split:])
    G = max(1, per_row)
    num = max(1, -(-C // (W * G)))
    k = I * W + J if G == 1 else (I * G + U % G) * W + J
    row = U if G == 1 else U // G
    return ([(row, tuple(range(split))), (k, tuple(range(split, len(shape))))], max(R, 1) * G, num,
            k.lt(C) if C % (W * G) else None)


def chunk_tiling(shape, num: int, W: int) -> tuple[list[Piece], int, int, Expr | None]:
    """Contiguous chunks of num*W elements per unit."""
    n = prod(shape)
    f = U * (num * W) + I * W + J
    return [(f, tuple(range(len(shape))))], max(1, -(-n // (num * W))), num, (f.lt(n) if n % (num * W) else None)


def cyclic_tiling(shape, units: int, W: int) -> tuple[list[Piece], int, int, Expr | None]:
    """Grid-stride: segment i of unit u is segment u + i*units of the flat space."""
    n = prod(shape)
    units = max(1, min(units, -(-n // W)))
    num = max(1, -(-n // (units * W)))
    f = U * W + I * (units * W) + J
    return [(f, tuple(range(len(shape))))], units, num, (f.lt(n) if n % (units * W) or num * units * W != n else None)


def and_(a: Expr | None, b: Expr | None) -> Expr | None:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def in_range(e: Expr, lo: int, hi: int) -> Expr:
    """lo <= e < hi."""
    return e.ge(lo) & e.lt(hi)


# ---- building a template graph --------------------------------------------------------

class Emitter:
    """Collects buffers and gOperators of one template graph."""

    def __init__(self, ctx: Ctx, tag: str = ""):
        self.ctx = ctx
        self.ops: list[GOp] = []
        self.buffers: dict[str, Buffer] = {}
        self.tag = tag
        self._stem = sanitize(f"{ctx.prefix}_{ctx.node.name}" if ctx.prefix else ctx.node.name)

    # buffers
    def tensor(self, t: str) -> str:
        info = self.ctx.tensors[t]
        name = self.ctx.names[t]
        self.buffers.setdefault(name, Buffer(name, Level.GLOBAL, max(info.size, 1), dtype_name(info.dtype)))
        return name

    def local(self, suffix: str, level: Level, size: int, dtype: str) -> str:
        name = f"{self._stem}_{suffix}"
        k = 1
        while name in self.buffers:  # every request is a fresh buffer
            name, k = f"{self._stem}_{suffix}{k}", k + 1
        self.buffers[name] = Buffer(name, level, size, dtype)
        return name

    # slices
    def gslice(self, t: str, index: Expr, num: int, width: int, vec: int = 1, valid=None, fill=0.0) -> MemorySlice:
        name = self.tensor(t)
        return MemorySlice(name, Level.GLOBAL, index, num, width, dtype_name(self.ctx.tensors[t].dtype), vec, valid,
                           float(fill))

    def reg(self, suffix: str, num: int, width: int, dtype: str, vec: int = 1, valid=None) -> MemorySlice:
        name = self.local(suffix, Level.REGISTER, num * width, dtype)
        return MemorySlice.strided(name, Level.REGISTER, 0, num, width, width, dtype, vec=vec, valid=valid)

    def op(self, args, inputs, outputs, guard=None) -> GOp:
        g = GOp(args, tuple(inputs), tuple(outputs), guard=guard, origin=self.ctx.node.name)
        self.ops.append(g)
        return g

    def graph(self, parallel: Parallel, template: str, extra_inputs=()) -> GIRGraph:
        node = self.ctx.node
        ins = tuple(dict.fromkeys(self.ctx.names[t] for t in node.inputs)) + tuple(extra_inputs)
        outs = tuple(self.ctx.names[t] for t in node.outputs)
        for t in node.inputs:
            self.tensor(t)
        return GIRGraph(f"{self._stem}", parallel, tuple(self.buffers.values()), tuple(self.ops), ins, outs,
                        templates=((node.name, template),))


class Infeasible(Exception):
    """This parameter point cannot be built for this node (e.g. vec > 1 on a strided access)."""


def fill_value(dt, value: float) -> float:
    """A fill representable in dt (-inf padding of an integer tensor becomes its lowest value)."""
    d = np.dtype(dt)
    if d.kind in "iu" and not np.isfinite(value):
        return float(np.iinfo(d).min if value < 0 else np.iinfo(d).max)
    return float(value)


def wrap_clamp(e: Expr, n: int) -> Expr:
    """ONNX index semantics: negative indices count from the end; out-of-range indices are
    clamped so a bad index cannot reach outside the buffer."""
    return emin(emax(select(e.lt(0), e + n, e), 0), n - 1)


def resolve_target(target) -> TargetSpec:
    return target if isinstance(target, TargetSpec) else get_target(target or "cuda")


def builds(c) -> bool:
    """Whether a candidate's graph can be built (templates raise Infeasible for shapes they cannot tile)."""
    try:
        c.build()
    except Infeasible:
        return False
    return True
