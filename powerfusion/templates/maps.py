"""Map templates: every op that computes each output element from input elements at
index-computable positions -- elementwise, broadcast, transpose (direct), reshape,
slice, concat, pad, gather, window. Each is load(s) GLOBAL -> REGISTER, at most one
elementwise gOperator, store REGISTER -> GLOBAL, over a tiling of an iteration space.

Tilings (`TileParams.kind`): `rows` (one unit per row of the trailing dims from
`split`, num = row/W segments), `chunk` (contiguous num*W elements per unit),
`cyclic` (grid-stride). W = lanes*vec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from powerfusion.gir.expr import Expr, J, U, affine_coefficient, const, substitute, variables
from powerfusion.gir.ir import Broadcast, Elementwise, Move, Parallel
from powerfusion.templates.common import (Ctx, Emitter, Infeasible, View, and_, chunk_tiling, coords,
                                          cyclic_tiling, prod, reg_dtype, rows_tiling, view_index)


# elements: rows from this long are also offered split over a group's units (4 warps); from
# 1024 until the group's result no longer needed a barrier to come back to every unit
# (rewrite/replicate.py: one barrier per statistic, as Triton's 4-8 warps per row)
LONG_ROW = 512
MID_GROUP_ROW = 2048   # elements: rows from this long are also offered over MID_GROUP units
MID_GROUP = 8          # units of a mid group: a row of 4096 fp16 is 16 per lane instead of 32
WIDE_ROW = 8192   # elements: rows from this long are also offered split over WIDE_GROUP units
WIDE_GROUP = 16   # units of a wide group (reduce.block's wide form): a row of 16384 is 32 fp32 per lane


@dataclass(frozen=True)
class TileParams:
    kind: str          # rows | chunk | cyclic
    vec: int
    split: int = 0     # rows: leading dims [:split] go to units
    num: int = 1       # chunk: segments per unit
    units: int = 0     # cyclic: number of units
    per_row: int = 1   # rows: consecutive units (of one group) per row


@dataclass(frozen=True)
class Source:
    """How a map reads one input at each space point: an affine view, or a custom index
    (gather, edge/reflect padding) from the coordinates; `valid` masks reads (fill instead)."""
    tensor: str
    view: View | None = None
    index: Callable[[list[Expr]], Expr] | None = None
    valid: Callable[[list[Expr]], Expr | None] | None = None
    fill: float = 0.0


@dataclass(frozen=True)
class Part:
    space: tuple[int, ...]
    sources: tuple[Source, ...]
    dst: str
    dst_view: View
    fn: str | None = None                       # elementwise function; None = a move of sources[0]
    params: tuple = ()
    guard: Callable[[list[Expr]], Expr | None] | None = None  # per-unit condition from the coordinates


def tile_width(tp: TileParams, shape, lanes: int) -> int:
    """W = lanes*vec; rows of one element (a reduction's output) are 1 x 1 per unit."""
    if tp.kind == "rows" and prod(shape[tp.split:]) == 1:
        return 1
    return lanes * tp.vec


def tiling(tp: TileParams, shape, lanes: int):
    W = tile_width(tp, shape, lanes)
    if tp.kind == "rows":
        return rows_tiling(shape, tp.split, W, tp.per_row)
    if tp.kind == "chunk":
        return chunk_tiling(shape, tp.num, W)
    if tp.kind == "cyclic":
        return cyclic_tiling(shape, tp.units, W)
    raise ValueError(f"unknown tiling {tp.kind}")


def load(em: Emitter, src: Source, pieces, shape, num: int, W: int, vec: int, tail: Expr | None,
         suffix: str, guard: Expr | None = None, into=None, lane_rows: bool = False):
    """GLOBAL -> REGISTER for one source; returns the num x W register slice holding it.
    An index that does not vary with j (or i) is loaded once and broadcast in registers.
    `lane_rows`: the tiling keeps each lane's vec elements inside one row of the space's last
    dim (map tilings do, where that dim is a multiple of vec), so a view that does not move
    along that dim (a per-channel parameter broadcast over NCHW) reads one value per lane and
    vector: loaded at the vector's first element (each lane's vec loads share an address)."""
    cs = coords(pieces, shape)
    index = src.index(cs) if src.index is not None else view_index(src.view, pieces, shape)
    valid = and_(tail, src.valid(cs) if src.valid is not None else None)
    dt = reg_dtype(em.ctx.tensors[src.tensor].dtype)
    if into is None and "j" not in variables(index):
        # one value per segment (or per unit): load num x 1 (or 1 x 1) and broadcast
        per_seg = "i" in variables(index)
        n1 = num if per_seg else 1
        zero = {"j": const(0)} if per_seg else {"j": const(0), "i": const(0)}
        v1 = substitute(valid, zero) if valid is not None else None
        g = em.gslice(src.tensor, index, n1, 1, 1, v1, src.fill)
        r = em.reg(f"{suffix}1", n1, 1, dt)
        em.op(Move(), [g], [r], guard)
        if W == 1 and n1 == num:
            return r
        b = em.reg(f"{suffix}b", n1, W, dt, vec)
        em.op(Broadcast("width"), [r], [b], guard)
        if n1 == num:
            return b
        out = em.reg(suffix, num, W, dt, vec)
        em.op(Broadcast("num"), [b], [out], guard)
        return out
    gvec = vec
    if vec > 1 and "j" in variables(index) and affine_coefficient(index, "j") != 1:
        if not (lane_rows and src.view is not None and src.view.lin[-1] == 0 and shape[-1] % vec == 0):
            raise Infeasible(f"vec={vec} needs a contiguous access of {src.tensor}")
        index, gvec = substitute(index, {"j": (J // vec) * vec}), 1
    g = em.gslice(src.tensor, index, num, W, gvec, valid, src.fill)
    r = into or em.reg(suffix, num, W, dt, vec)
    em.op(Move(), [g], [r], guard)
    return r


def store(em: Emitter, reg, dst: str, view: View, pieces, shape, num: int, W: int, vec: int, tail, guard=None):
    index = view_index(view, pieces, shape)
    if vec > 1 and affine_coefficient(index, "j") != 1:
        raise Infeasible(f"vec={vec} needs a contiguous store of {dst}")
    em.op(Move(), [reg], [em.gslice(dst, index, num, W, vec, tail)], guard)


def build_parts(ctx: Ctx, tp: TileParams, parts: Sequence[Part], template: str):
    """One graph from map parts; parts run one after another on units 0..units_k-1
    (guarded where a part needs fewer units than the widest)."""
    em = Emitter(ctx)
    tiled = [tiling(tp, p.space, ctx.lanes) for p in parts]
    units = max(t[1] for t in tiled)
    for k, (p, (pieces, n_units, num, tail)) in enumerate(zip(parts, tiled)):
        guard = U.lt(n_units) if n_units < units else None
        if p.guard is not None:
            guard = and_(guard, p.guard(coords(pieces, p.space)))
        tag = f"p{k}_" if len(parts) > 1 else ""
        W = tile_width(tp, p.space, ctx.lanes)
        regs = [load(em, s, pieces, p.space, num, W, tp.vec, tail, f"{tag}in{n}", guard, lane_rows=True)
                for n, s in enumerate(p.sources)]
        if p.fn is not None:
            out = em.reg(f"{tag}out", num, W, reg_dtype(ctx.tensors[p.dst].dtype), tp.vec)
            em.op(Elementwise(p.fn, p.params), regs, [out], guard)
        else:
            out = regs[0]
        store(em, out, p.dst, p.dst_view, pieces, p.space, num, W, tp.vec, tail, guard)
    # a row over more units than the context's group is one group (as reduce.block's): with
    # the context's group the group sizes differ and nothing lines up with the reduction
    upg = tp.per_row if tp.kind == "rows" and tp.per_row > ctx.upg else ctx.upg
    return em.graph(Parallel(units, upg, ctx.lanes), template)


def map_tilings(shape, vecs: Sequence[int], lanes: int, groups_hint: int, kinds=("rows", "chunk", "cyclic"),
                splits: Sequence[int] | None = None, group: int = 1, wide: bool = False) -> list[TileParams]:
    """The parameter space of a map over `shape`: rows over the trailing 1..rank-1 dims
    (innermost first, so row-per-unit patterns line up with reductions), chunks and grid-stride.
    Long rows (and one-element rows, a reduction's result) also come split over the `group`
    units of a group, matching reduce.block: a row too long for one unit's registers. Rows
    from WIDE_ROW elements (and, with `wide`, one-element rows) also over WIDE_GROUP units."""
    rank = len(shape)
    out: list[TileParams] = []

    def vsets(extent):  # the widest vector dividing the extent, and scalar
        return list(dict.fromkeys((max(v for v in vecs if extent % v == 0), 1)))
    if "rows" in kinds and rank and shape[-1] == 1 and prod(shape) > 1:
        s = max(d for d in range(rank) if shape[d] != 1) + 1  # one element per unit: a reduction's row
        out.append(TileParams("rows", 1, split=s))
        if group > 1:
            out.append(TileParams("rows", 1, split=s, per_row=group))
            if wide:
                out.append(TileParams("rows", 1, split=s, per_row=MID_GROUP))
                out.append(TileParams("rows", 1, split=s, per_row=WIDE_GROUP))
    if "rows" in kinds:
        order = list(splits if splits is not None else range(rank - 1, 0, -1))
        # rows that occupy at least half the lanes first (innermost first), then the rest
        order.sort(key=lambda s: prod(shape[s:]) * 2 < lanes)
        for s in order:
            if 0 < s < rank and prod(shape[s:]) > 1:
                out += [TileParams("rows", v, split=s) for v in vsets(prod(shape[s:]))]
                if group > 1 and prod(shape[s:]) >= LONG_ROW:
                    out += [TileParams("rows", v, split=s, per_row=group) for v in vsets(prod(shape[s:]))]
                if group > 1 and prod(shape[s:]) >= MID_GROUP_ROW:
                    out += [TileParams("rows", v, split=s, per_row=MID_GROUP) for v in vsets(prod(shape[s:]))]
                if group > 1 and prod(shape[s:]) >= WIDE_ROW:
                    out += [TileParams("rows", v, split=s, per_row=WIDE_GROUP) for v in vsets(prod(shape[s:]))]
    n = prod(shape)
    for v in vsets(n):
        if "chunk" in kinds:
            out.append(TileParams("chunk", v, num=1))
            if n > 4 * lanes * v:
                out.append(TileParams("chunk", v, num=4))
        if "cyclic" in kinds and n > lanes * v:
            out.append(TileParams("cyclic", v, units=groups_hint))
    return out


def vecs_for(ctx: Ctx, tensors: Sequence[str]) -> list[int]:
    size = max(ctx.tensors[t].dtype.itemsize for t in tensors)
    return [v for v in (8, 4, 2, 1) if v * size <= 16]


def filter_vecs(tps: list[TileParams], shape, vecs) -> list[TileParams]:
    ok = set(vecs)
    return [t for t in tps if t.vec in ok]
