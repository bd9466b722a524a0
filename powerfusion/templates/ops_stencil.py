"""Depthwise Conv as a stencil: each group stages the input rows its units' windows cover
(the output rows plus the halo) in a SHARED tile once, syncs, and every unit reads its
windows from there (docs/templates.md, "Stencils").

The units are laid out as `conv.depthwise.cols` lays them out -- one unit per chunk of W
output columns of one output row, rows in (n, c, oh) order -- so the BatchNorm and activation
after the conv line up with the conv's output and stay in its kernel. What changes is where a
unit's windows come from: `cols` gathers KH x KW elements per output from GLOBAL (49 loads
per output for a 7x7 window, each a separate cache transaction), the stencil loads each input
element of the group's rows once (coalesced, padding written as zeros) and reads the windows
from SHARED memory.

Input rows are addressed in a *virtual row space*: output plane P (over n and the output
channel) owns the NH = (OH-1)*sh + (KH-1)*dh + 1 padded input rows its windows cover, at
virtual rows [P*NH, (P+1)*NH). Output row (P, oh) reads virtual rows P*NH + oh*sh + kh*dh, so a
group's rows -- even where they cross from one plane into the next -- cover one contiguous
range of virtual rows, which is the tile. Its height is the largest such range over the
groups, computed exactly from the static shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerfusion import basic as B
from powerfusion.gir.expr import Expr, I, J, U, const
from powerfusion.gir.ir import Elementwise, Level, MemorySlice, Move, Parallel, Reduce, Scope, Sync
from powerfusion.templates.common import Candidate, Ctx, Emitter, Infeasible, and_, builds, in_range, reg_dtype
from powerfusion.templates.conv_shape import ConvShape, conv_shape
from powerfusion.templates.maps import load

MAX_TILE_BYTES = 24 * 1024   # per group: leaves room for several resident groups per SM


@dataclass(frozen=True)
class StencilParams:
    layout: str       # rows: a unit per W columns of one output row (cols' layout); flat: W consecutive outputs
    vec: int          # lanes x vec = W outputs per unit (vector width of the output store)


@dataclass(frozen=True)
class _Geometry(ConvShape):
    """The conv's shapes, and the stencil's tiling of them for one layout and W."""
    W: int
    G: int       # units per group
    L: int       # lanes per unit
    flat: bool   # units over the flat outputs (else over output rows, in chunks of W columns)

    @property
    def nch(self) -> int:
        return -(-self.OW // self.W)

    @property
    def rows(self) -> int:
        return self.N * self.Cout * self.OH

    @property
    def units(self) -> int:
        """Whole groups: every unit of a group takes part in staging the tile and in its sync."""
        busy = -(-self.rows * self.OW // self.W) if self.flat else self.rows * self.nch
        return -(-busy // self.G) * self.G

    @property
    def NH(self) -> int:
        """Virtual rows per output plane: the padded input rows its windows cover."""
        return (self.OH - 1) * self.sh + (self.KH - 1) * self.dh + 1

    @property
    def TW(self) -> int:
        """Tile columns: the padded input columns the windows of a row cover."""
        return (self.OW - 1) * self.sw + (self.KW - 1) * self.dw + 1

    def virt(self, r):
        """First virtual row read by output row r (flat over n, c, oh); int or Expr."""
        return (r // self.OH) * self.NH + (r % self.OH) * self.sh

    def first_row(self, g):
        """The first output row of group g (int array or Expr)."""
        return (g * self.G * self.W) // self.OW if self.flat else (g * self.G) // self.nch

    def last_row(self, g):
        last = (g * self.G * self.W + self.G * self.W - 1) // self.OW if self.flat else (g * self.G + self.G - 1) // self.nch
        return np.minimum(last, self.rows - 1)

    @property
    def TR(self) -> int:
        """Tile rows: the largest range of virtual rows any group reads, exactly."""
        g = np.arange(self.units // self.G, dtype=np.int64)
        return int(np.max(self.virt(self.last_row(g)) - self.virt(self.first_row(g)))) + (self.KH - 1) * self.dh + 1

    def output(self) -> tuple[Expr, Expr, Expr, Expr | None]:
        """(row r, column ow, flat output q = r*OW + ow, tail mask) of element (u, i, j)."""
        if self.flat:
            q = U * self.W + J
            n = self.rows * self.OW
            return q // self.OW, q % self.OW, q, (q.lt(n) if self.units * self.W != n else None)
        r, ow = U // self.nch, (U % self.nch) * self.W + J
        tail = and_(ow.lt(self.OW) if self.OW % self.W else None,
                    r.lt(self.rows) if self.units > self.rows * self.nch else None)
        return r, ow, r * self.OW + ow, tail


def _geometry(ctx: Ctx, p: StencilParams) -> _Geometry:
    return _Geometry(**conv_shape(ctx, "stencil").values(), W=ctx.lanes * p.vec, G=ctx.upg, L=ctx.lanes,
                     flat=p.layout == "flat")


def conv_stencil(ctx: Ctx) -> list[Candidate]:
    """Stencil candidates of a depthwise Conv (its checks are `ops_matmul.conv`'s). Rows layout:
    the vectors `cols` offers (the widest whose W fits the row, scalar, and the one covering a
    row narrower than lanes x vmax with one unit), so the two line up with the same maps, and
    the narrowest covering the row with one unit (a lane's neighbouring outputs share window
    taps, which nvcc loads once, and the tap's weight). Flat
    layout (scalar: a lane's outputs may span two channels, whose weights differ): for rows
    narrower than a warp, where one unit per row would leave lanes idle (7 of 32 at 7x7)."""
    from powerfusion.templates.ops_matmul import _vecs
    xs = ctx.tensors[ctx.node.inputs[0]].shape
    ys = ctx.tensors[ctx.node.outputs[0]].shape
    if len(xs) != 4 or ys[3] == 1:
        return []
    size = max(ctx.tensors[t].dtype.itemsize for t in list(ctx.node.inputs) + list(ctx.node.outputs))
    vmax = max(v for v in (8, 4, 2, 1) if v * size <= 16)
    vecs = _vecs(vmax, ctx.lanes, ys[3], whole=True)
    # and the narrowest vector covering the row with one unit: fewest idle lanes (56: 2, not 4)
    vecs += [v for v in (2, 4, 8) if v <= vmax and ctx.lanes * v >= ys[3] > ctx.lanes * v // 2]
    points = [StencilParams("rows", v) for v in dict.fromkeys(vecs)]
    if ys[3] < ctx.lanes:
        points.append(StencilParams("flat", 1))
    out = []
    for p in points:
        c = Candidate(_name(ctx), p, ctx, _build)
        if builds(c):
            out.append(c)
    return out


def _build(ctx: Ctx, p: StencilParams):
    g = _geometry(ctx, p)
    x, w = ctx.node.inputs[:2]
    y = ctx.node.outputs[0]
    xdt = reg_dtype(ctx.tensors[x].dtype)
    acc = reg_dtype(ctx.tensors[y].dtype)
    TR, TW = g.TR, g.TW
    if TR * TW * np.dtype(xdt).itemsize > MAX_TILE_BYTES:
        raise Infeasible(f"a {TR}x{TW} input tile exceeds {MAX_TILE_BYTES} B of shared memory per group")
    em = Emitter(ctx)
    r, ow, q, tail = g.output()
    K = g.KH * g.KW
    # weights (and bias) first, through cols' Product sources: their loads overlap the staging
    from powerfusion.templates.ops_matmul import _conv_product, _involution_product
    pr = _involution_product(ctx) if isinstance(ctx.node.op, B.Involution) else _conv_product(ctx)
    space, n_out = pr.space, pr.n_out
    out_dims, red_dims = tuple(range(n_out)), tuple(range(n_out, len(space)))
    pieces = [(r, out_dims[:-1]), (ow, out_dims[-1:]), (I, red_dims)]
    rw = load(em, pr.b, pieces, space, K, g.W, p.vec, tail, "w")
    rbias = load(em, pr.bias, pieces[:2], space[:n_out], 1, g.W, p.vec, tail, "bias") if pr.bias else None
    v0 = g.virt(g.first_row(U // g.G))           # the group's first virtual row
    tile = em.local("tile", Level.SHARED, TR * TW, xdt)
    written = _stage(em, g, x, tile, v0, xdt)
    # the windows: segment i = window tap (kh, kw), read from the tile
    kh, kw = (I // g.KW, I % g.KW) if g.KW > 1 else (I, const(0))
    at = (g.virt(r) - v0 + kh * g.dh) * TW + ow * g.sw + kw * g.dw
    staged = MemorySlice(tile, Level.SHARED, at, K, g.W, xdt, 1, tail)
    em.op(Sync(Scope.BLOCK), [written], [staged])
    rx = em.reg("win", K, g.W, acc, p.vec)
    em.op(Move(), [staged], [rx])
    prod_r = em.reg("prod", K, g.W, acc, p.vec)
    em.op(Elementwise("mul"), [rx, rw], [prod_r])
    seen = MemorySlice.strided(prod_r.buffer, Level.REGISTER, 0, K, g.W, g.W, acc, p.vec, tail)
    if K > 1:
        part = em.reg("part", 1, g.W, acc, p.vec)
        em.op(Reduce("sum", "num"), [seen], [part])
        seen = part
    if rbias is not None:
        tot = em.reg("out", 1, g.W, acc, p.vec)
        em.op(Elementwise("add"), [seen, rbias], [tot])
        seen = tot
    em.op(Move(), [seen], [em.gslice(y, q, 1, g.W, p.vec, tail)])
    return em.graph(Parallel(g.units, g.G, ctx.lanes), _name(ctx))


def _name(ctx: Ctx) -> str:
    return "involution.stencil" if isinstance(ctx.node.op, B.Involution) else "conv.depthwise.stencil"


def _stage_num(g: _Geometry) -> int:
    return max(1, -(-g.TR * g.TW // (g.G * g.L)))


def _stage_index(g: _Geometry) -> Expr:
    """Tile element staged by (u, i, j): the group's units deal the tile round-robin in
    segments of one warp width, so consecutive lanes load consecutive columns."""
    return (I * g.G + U % g.G) * g.L + J


def _stage_tail(g: _Geometry) -> Expr | None:
    te = g.TR * g.TW
    return _stage_index(g).lt(te) if te % (g.G * g.L) else None


def _stage(em: Emitter, g: _Geometry, x: str, tile: str, v0: Expr, dt: str) -> MemorySlice:
    """GLOBAL -> REGISTER -> SHARED: tile element f is virtual row v0 + f // TW, padded column
    f % TW; padding rows and columns (and rows past the last plane) are staged as zeros."""
    f = _stage_index(g)
    num, L = _stage_num(g), g.L
    v = v0 + f // g.TW
    plane, ih, iw = v // g.NH, v % g.NH - g.ph, f % g.TW - g.pw
    mult = g.Cout // g.C
    in_plane = plane if mult == 1 else (plane // g.Cout) * g.C + (plane % g.Cout) // mult
    valid = and_(_stage_tail(g), plane.lt(g.N * g.Cout) if _past_last_plane(g) else None)
    if g.ph or (g.NH - g.ph) > g.IH:
        valid = and_(valid, in_range(ih, 0, g.IH))
    if g.pw or (g.TW - g.pw) > g.IW:
        valid = and_(valid, in_range(iw, 0, g.IW))
    src = em.gslice(x, (in_plane * g.IH + ih) * g.IW + iw, num, L, 1, valid, 0.0)
    staged = em.reg("stage", num, L, dt)
    em.op(Move(), [src], [staged])
    written = MemorySlice(tile, Level.SHARED, f, num, L, dt, 1, _stage_tail(g))
    em.op(Move(), [staged], [written])
    return written


def _past_last_plane(g: _Geometry) -> bool:
    """Does the last group's tile run past the last plane's virtual rows?"""
    return g.virt(g.first_row(g.units // g.G - 1)) + g.TR > g.N * g.Cout * g.NH
