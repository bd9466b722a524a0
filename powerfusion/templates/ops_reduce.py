"""Reduce templates. The input is viewed as rows r (the kept dims, in order; the output's
flat index) by reduced positions k (the reduced dims), any axes:

* `row_warp`: one unit per row; its lanes walk k in num segments of W; reduce over num
  (lane-local), then over width (the WARP exchange).
* `cols`: lanes over W consecutive rows, num = K: reduce over num only (no exchange);
  coalesced when the reduced axes are not innermost (the transposed layout).
* `block`: G units (one group) per row; partials through SHARED, a BLOCK sync, the
  group's first unit finishes (each lane adding the G partials itself where G <= 4; the search's
  `replicated_variant`, rewrite/replicate.py, lets every unit finish and drops the barrier
  that hands the result back). G is the context's group size, or WIDE_GROUP for rows from
  WIDE_ROW elements (fewer slots per lane: no streaming, the row read once).
* `grid`: S units per row in different groups; partials to a GLOBAL scratch buffer,
  a DEVICE sync (a second kernel), R units finish.
Register tiles that hold padded elements carry the load's `valid`, so reductions skip them.
"""
from __future__ import annotations

from dataclasses import dataclass

from powerfusion import basic as B
from powerfusion.gir.expr import I, J, U, affine_coefficient
from powerfusion.gir.ir import Level, MemorySlice, Move, Parallel, Reduce, Scope, Sync
from powerfusion.templates.maps import MID_GROUP, MID_GROUP_ROW, WIDE_GROUP, WIDE_ROW
from powerfusion.templates.common import (builds, Candidate, Ctx, Emitter, Infeasible, View, contiguous_strides, prod,
                                          reg_dtype, view_index)


# groups of up to this many units add their partials lane-locally (G registers a lane); larger
# groups spread them over the lanes and shuffle: 16 partials held in registers took a 16-warp
# LayerNorm row of 16384 from 58 to 72 registers a lane (ptxas, sm_90), one block per SM
# instead of two
LANE_LOCAL_PARTIALS = 4


@dataclass(frozen=True)
class ReduceParams:
    style: str       # row_warp | cols | block | grid
    vec: int = 1
    split: int = 1   # grid: units per row
    group: int = 0   # block: units per row (0: the context's group size)


def _geometry(ctx: Ctx):
    op: B.Reduce = ctx.node.op
    x = ctx.node.inputs[0]
    shape = ctx.tensors[x].shape
    axes = tuple(a % len(shape) for a in op.axes) if shape else ()
    kept = tuple(d for d in range(len(shape)) if d not in axes)
    return op, x, shape, axes, kept, prod([shape[d] for d in kept]), prod([shape[d] for d in axes])


def reduce(ctx: Ctx) -> list[Candidate]:
    op, x, shape, axes, kept, R, K = _geometry(ctx)
    if op.fn not in ("sum", "max", "min", "prod"):
        raise ctx.error(f"reduce function '{op.fn}' has no template")
    size = max(ctx.tensors[x].dtype.itemsize, ctx.tensors[ctx.node.outputs[0]].dtype.itemsize)
    vecs = [v for v in (8, 4, 2, 1) if v * size <= 16]
    inner = bool(axes) and axes == tuple(range(len(shape) - len(axes), len(shape)))
    pts = []
    row = [ReduceParams("row_warp", v) for v in (vecs[0], 1) if K % v == 0]
    cols = [ReduceParams("cols", v) for v in (vecs[0], 1) if R % v == 0 and R > 1]
    pts += (row + cols) if inner or R == 1 else (cols + row)
    if ctx.upg > 1:
        pts += [ReduceParams("block", v) for v in (vecs[0], 1) if K % v == 0]
        if MID_GROUP_ROW <= K < WIDE_ROW:   # 8 warps a row (Triton's choice from 2048 elements)
            pts += [ReduceParams("block", v, group=MID_GROUP) for v in (vecs[0], 1) if K % v == 0]
        if K >= WIDE_ROW:   # a wide group: a row of 16384 is 32 fp32 per lane instead of 128
            pts += [ReduceParams("block", v, group=WIDE_GROUP) for v in (vecs[0], 1) if K % v == 0]
    pts += [ReduceParams("grid", 1, s) for s in (2, 8)]
    out, seen = [], set()
    for p in pts:
        if p in seen:
            continue
        seen.add(p)
        c = Candidate(f"reduce.{p.style}", p, ctx, _build)
        if builds(c):
            out.append(c)
    return out


def _build(ctx: Ctx, p: ReduceParams):
    op, x, shape, axes, kept, R, K = _geometry(ctx)
    y = ctx.node.outputs[0]
    W = ctx.lanes * p.vec
    view = View(contiguous_strides(shape))
    em = Emitter(ctx)
    dt = reg_dtype(ctx.tensors[x].dtype)
    acc = reg_dtype(ctx.tensors[y].dtype)

    def rows_load(row_expr, k_expr, num, span, tag=""):
        """Load x[row, k] (num x W; k < span covers the row), return the register tile seen
        with the load's mask."""
        pieces = [(row_expr, kept), (k_expr, axes)]
        index = view_index(view, pieces, shape)
        valid = k_expr.lt(K) if span != K else None
        if p.vec > 1 and affine_coefficient(index, "j") != 1:
            raise Infeasible("vec > 1 needs contiguous reduced axes")
        r = em.reg(f"{tag}x", num, W, dt, p.vec)
        em.op(Move(), [em.gslice(x, index, num, W, p.vec, valid)], [r])
        return MemorySlice.strided(r.buffer, Level.REGISTER, 0, num, W, W, dt, p.vec, valid)

    def to_scalar(tile, tag="", guard=None):
        """num x W (masked) -> 1 x 1: over num (lane-local), then over width (lane exchange)."""
        if tile.width == 1:   # one column (a group's partials): the lane-local reduction is all
            s = em.reg(f"{tag}sum", 1, 1, acc)
            em.op(Reduce(op.fn, "num"), [tile], [s], guard)
            return s
        if tile.num > 1:
            part = em.reg(f"{tag}part", 1, tile.width, acc, tile.vec)
            em.op(Reduce(op.fn, "num"), [tile], [part], guard)
            tile = part
        s = em.reg(f"{tag}sum", 1, 1, acc)
        em.op(Reduce(op.fn, "width"), [tile], [s], guard)
        return s

    if p.style == "row_warp":
        num = max(1, -(-K // W))
        s = to_scalar(rows_load(U, I * W + J, num, num * W))
        em.op(Move(), [s], [em.gslice(y, U, 1, 1)])
        return em.graph(Parallel(max(R, 1), ctx.upg, ctx.lanes), "reduce.row_warp")

    if p.style == "cols":
        f = U * W + J
        pieces = [(f, kept), (I, axes)]
        index = view_index(view, pieces, shape)
        if p.vec > 1 and affine_coefficient(index, "j") != 1:
            raise Infeasible("vec > 1 needs contiguous kept axes")
        tail = f.lt(R) if R % W else None
        r = em.reg("x", K, W, dt, p.vec)
        em.op(Move(), [em.gslice(x, index, K, W, p.vec, tail)], [r])
        part = em.reg("part", 1, W, acc, p.vec)
        em.op(Reduce(op.fn, "num"), [MemorySlice.strided(r.buffer, Level.REGISTER, 0, K, W, W, dt, p.vec, tail)],
              [part])
        em.op(Move(), [part], [em.gslice(y, f, 1, W, p.vec, tail)])
        return em.graph(Parallel(-(-R // W), ctx.upg, ctx.lanes), "reduce.cols")

    if p.style == "block":
        G = p.group or ctx.upg
        num = max(1, -(-K // (G * W)))
        s = to_scalar(rows_load(U // G, (I * G + U % G) * W + J, num, num * G * W))
        shared = em.local("partials", Level.SHARED, G, acc)
        sw = MemorySlice(shared, Level.SHARED, U % G, 1, 1, acc)
        em.op(Move(), [s], [sw])
        first = (U % G).eq(0)
        if G <= LANE_LOCAL_PARTIALS:
            # every lane reads the G partials (G x 1, a broadcast read) and adds them in its
            # own registers: no shuffle round (a 32-lane tile of G partials takes 5 shuffles)
            sr = MemorySlice(shared, Level.SHARED, I, G, 1, acc)
            em.op(Sync(Scope.BLOCK), [sw], [sr])
            q = em.reg("q", G, 1, acc)
            em.op(Move(), [sr], [q], first)
            qv = MemorySlice.strided(q.buffer, Level.REGISTER, 0, G, 1, 1, acc, 1)
        else:
            Wl = ctx.lanes * -(-G // ctx.lanes)
            sr = MemorySlice(shared, Level.SHARED, J, 1, Wl, acc, valid=J.lt(G) if Wl != G else None)
            em.op(Sync(Scope.BLOCK), [sw], [sr])
            q = em.reg("q", 1, Wl, acc)
            em.op(Move(), [sr], [q], first)
            qv = MemorySlice.strided(q.buffer, Level.REGISTER, 0, 1, Wl, Wl, acc, 1, sr.valid)
        s2 = to_scalar(qv, "fin_", first)
        em.op(Move(), [s2], [em.gslice(y, U // G, 1, 1)], first)
        return em.graph(Parallel(R * G, G, ctx.lanes), "reduce.block")

    if p.style == "grid":
        S = p.split
        num = max(1, -(-K // (S * W)))
        s = to_scalar(rows_load(U // S, (I * S + U % S) * W + J, num, num * S * W))
        scratch = em.local("partials", Level.GLOBAL, R * S, acc)
        gw = MemorySlice(scratch, Level.GLOBAL, U, 1, 1, acc)
        Wl = ctx.lanes
        num2 = -(-S // Wl)
        k2 = I * Wl + J
        gr = MemorySlice(scratch, Level.GLOBAL, U * S + k2, num2, Wl, acc, valid=k2.lt(S) if num2 * Wl != S else None)
        em.op(Move(), [s], [gw])
        em.op(Sync(Scope.DEVICE), [gw], [gr])
        fin = U.lt(R)
        q = em.reg("q", num2, Wl, acc)
        em.op(Move(), [gr], [q], fin)
        qv = MemorySlice.strided(q.buffer, Level.REGISTER, 0, num2, Wl, Wl, acc, 1, gr.valid)
        s2 = to_scalar(qv, "fin_", fin)
        em.op(Move(), [s2], [em.gslice(y, U, 1, 1)], fin)
        return em.graph(Parallel(R * S, ctx.upg, ctx.lanes), "reduce.grid")
    raise ValueError(p.style)
