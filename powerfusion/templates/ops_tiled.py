"""Templates with structure beyond one map: the transpose tiled through SHARED memory
and the concat with one unit per output row (guarded loads from the input owning the row)."""
from __future__ import annotations

from dataclasses import dataclass

from powerfusion.gir.expr import I, J, U
from powerfusion.gir.ir import Level, MemorySlice, Move, Parallel, Scope, Sync
from powerfusion.templates.common import (Candidate, Ctx, Emitter, Infeasible, View, and_, contiguous_strides,
                                          contiguous_view, coords, in_range, prod, reg_dtype, view_index)
from powerfusion.templates.maps import (Source, TileParams, load, map_tilings, store, tile_width, tiling,
                                        vecs_for)


@dataclass(frozen=True)
class TileTransposeParams:
    tile: int          # T: a T x T tile per group
    units: int         # units per group (= the graph's group size)


def transpose_tiled(ctx: Ctx) -> list[Candidate]:
    perm = ctx.node.op.perm
    x = ctx.node.inputs[0]
    ishape = ctx.tensors[x].shape
    n = len(perm)
    if n < 2 or perm[-1] == n - 1 or ishape[perm[-1]] == 1 or ishape[-1] == 1:
        return []  # the innermost dim stays put: a direct copy is already contiguous on both sides
    T = ctx.lanes if ctx.lanes >= 16 else 32
    G = ctx.upg
    if T % G:
        return []
    p = TileTransposeParams(T, G)
    return [Candidate("transpose.tiled", p, ctx, _build_tiled)]


def _build_tiled(ctx: Ctx, p: TileTransposeParams):
    perm = ctx.node.op.perm
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    ishape = ctx.tensors[x].shape
    n = len(perm)
    ist, ost = contiguous_strides(ishape), contiguous_strides(ctx.tensors[out].shape)
    inv = [perm.index(e) for e in range(n)]
    a, b = n - 1, perm[-1]            # input's innermost dim; the dim that becomes the output's innermost
    X, Y, T, G = ishape[b], ishape[a], p.tile, p.units
    nx, ny = -(-X // T), -(-Y // T)
    batch = [e for e in range(n) if e not in (a, b)]
    bsizes = tuple(ishape[e] for e in batch)
    g, t = U // G, U % G
    bflat, tx, ty = g // (nx * ny), (g // ny) % nx, g % ny
    bpieces = [(bflat, tuple(range(len(batch))))]
    in_batch = view_index(View(tuple(ist[e] for e in batch)), bpieces, bsizes)
    out_batch = view_index(View(tuple(ost[inv[e]] for e in batch)), bpieces, bsizes)
    num = T // G
    r = t + I * G                      # tile row of this segment
    em = Emitter(ctx)
    dt = reg_dtype(ctx.tensors[x].dtype)
    xi, yi = tx * T + r, ty * T + J     # read: input rows along b, columns along a
    vin = and_(xi.lt(X) if X % T else None, yi.lt(Y) if Y % T else None)
    xr = em.reg("x", num, T, dt)
    em.op(Move(), [em.gslice(x, in_batch + xi * ist[b] + yi, num, T, 1, vin)], [xr])
    tile = em.local("tile", Level.SHARED, T * (T + 1), dt)  # +1 column: no bank conflicts on the column read
    sw = MemorySlice(tile, Level.SHARED, r * (T + 1) + J, num, T, dt)
    sr = MemorySlice(tile, Level.SHARED, J * (T + 1) + r, num, T, dt)
    em.op(Move(), [xr], [sw])
    em.op(Sync(Scope.BLOCK), [sw], [sr])
    yr = em.reg("y", num, T, dt)
    em.op(Move(), [sr], [yr])
    oa, ob = ty * T + r, tx * T + J     # write: output rows along a, columns along b
    vout = and_(oa.lt(Y) if Y % T else None, ob.lt(X) if X % T else None)
    em.op(Move(), [yr], [em.gslice(out, out_batch + oa * ost[inv[a]] + ob, num, T, 1, vout)])
    units = prod(bsizes) * nx * ny * G
    return em.graph(Parallel(units, G, ctx.lanes), "transpose.tiled")


def concat_rows(ctx: Ctx) -> list[Candidate]:
    """One unit per output row (rows of the dims after the axis): each row comes from one input,
    loaded under a guard on the row's axis coordinate into one register tile, stored once."""
    axis = ctx.node.op.axis
    out = ctx.node.outputs[0]
    oshape = ctx.tensors[out].shape
    rank = len(oshape)
    if axis >= rank - 1 and rank > 0:
        return []
    hint = ctx.target.groups_concurrent * ctx.upg * 4
    res = []
    for tp in map_tilings(oshape, vecs_for(ctx, list(ctx.node.inputs) + [out]), ctx.lanes, hint, ("rows",),
                          range(rank - 1, axis, -1)):
        if tp.split <= axis:
            continue
        c = Candidate("concat.rows", tp, ctx, _build_concat_rows)
        try:
            c.build()
        except Infeasible:
            continue
        res.append(c)
    return res


def _build_concat_rows(ctx: Ctx, tp: TileParams):
    axis = ctx.node.op.axis
    out = ctx.node.outputs[0]
    oshape = ctx.tensors[out].shape
    W = tile_width(tp, oshape, ctx.lanes)
    pieces, units, num, tail = tiling(tp, oshape, ctx.lanes)
    ca = coords(pieces, oshape)[axis]
    em = Emitter(ctx)
    reg = em.reg("x", num, W, reg_dtype(ctx.tensors[out].dtype), tp.vec)
    off = 0
    for t in ctx.node.inputs:
        s = ctx.tensors[t].shape
        st = contiguous_strides(s)
        src = Source(t, View(st, -off * st[axis]))
        load(em, src, pieces, oshape, num, W, tp.vec, tail, "x", guard=in_range(ca, off, off + s[axis]), into=reg)
        off += s[axis]
    store(em, reg, out, contiguous_view(oshape), pieces, oshape, num, W, tp.vec, tail)
    return em.graph(Parallel(units, ctx.upg, ctx.lanes), "concat.rows")
