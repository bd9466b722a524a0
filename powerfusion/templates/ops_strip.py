"""Depthwise Conv with the window's columns reused in registers (`conv.depthwise.strip`,
docs/gir.md "Strips").

Each lane computes vec consecutive outputs of one row. `cols` gathers KH x KW x vec elements
per lane from GLOBAL, one scalar load each (a shifted window is off the vector grid); here a
lane loads, for each window row kh, the aligned vec-wide chunks of that input row that its
outputs' windows cover -- its own chunk and ceil(pad / vec) neighbouring chunks each side, one
vector access each -- and builds its KH x KW x vec window tile from them by moves inside its
own registers (rendered as register copies, which the compiler folds away). For a 3x3 window
and vec 4: 9 vector loads per lane and 4 outputs instead of 36 scalar loads; 7x7: 21 instead
of 196.

Layouts: `rows`, cols' own (one unit per W = lanes x vec output columns of one row, the weights
one value per unit, broadcast), so the maps after the conv line up as with `cols`; `flat`, a
unit per W consecutive outputs of the flattened output (every lane busy where rows are
narrower than W; each lane loads its channel's weights), lining up with chunk maps. Strides
above 1 keep the structure with element loads (the chunks are not contiguous in j); the
template is offered for vec > 1 only, where a chunk holds more than one element a lane reuses.
"""
from __future__ import annotations

from dataclasses import dataclass

from powerfusion import basic as B
from powerfusion.gir.expr import Expr, I, J, U, affine_coefficient, variables
from powerfusion.gir.ir import Elementwise, Level, MemorySlice, Move, Parallel, Reduce
from powerfusion.templates.common import Candidate, Ctx, Emitter, and_, builds, coords, in_range, prod, reg_dtype
from powerfusion.templates.conv_shape import ConvShape, conv_shape
from powerfusion.templates.maps import load


@dataclass(frozen=True)
class StripParams:
    layout: str   # rows: a unit per W = lanes x vec columns of one output row (cols' layout)
    vec: int      # output columns per lane, and the width of each input chunk a lane loads


@dataclass(frozen=True)
class _Conv(ConvShape):
    def chunks(self, vec: int) -> range:
        """Chunk offsets q (in vectors, relative to the lane's first input column) whose
        columns some tap of the lane's vec outputs reads."""
        lo = (-self.pw) // vec
        hi = ((vec - 1) * self.sw + (self.KW - 1) * self.dw - self.pw) // vec
        return range(lo, hi + 1)


def _conv(ctx: Ctx) -> _Conv:
    return _Conv(**conv_shape(ctx, "strip").values())


def conv_strip(ctx: Ctx) -> list[Candidate]:
    """Strip candidates of a depthwise Conv (its checks are `ops_matmul.conv`'s): the vectors
    > 1 that `cols` offers (so the two line up with the same maps after them) and the narrowest
    covering a row with one unit (fewest idle lanes: 56 columns, vec 2)."""
    from powerfusion.templates.ops_matmul import _vecs
    xs = ctx.tensors[ctx.node.inputs[0]].shape
    ys = ctx.tensors[ctx.node.outputs[0]].shape
    if len(xs) != 4 or ys[3] == 1 or ctx.lanes < 2:
        return []
    size = max(ctx.tensors[t].dtype.itemsize for t in list(ctx.node.inputs) + list(ctx.node.outputs))
    vmax = max(v for v in (8, 4, 2, 1) if v * size <= 16)
    vecs = _vecs(vmax, ctx.lanes, ys[3], whole=True)
    vecs += [v for v in (2, 4, 8) if v <= vmax and ctx.lanes * v >= ys[3] > ctx.lanes * v // 2]
    points = [StripParams("rows", v) for v in dict.fromkeys(vecs) if v > 1]
    # flat: every lane busy (a 56-wide row leaves 18 of 32 lanes idle at vec 4), a lane's vec
    # outputs in one row; the vector the chunk maps after it take (the widest dividing the
    # output), else the BatchNorm and activation cannot line up with it
    v = max(v for v in (8, 4, 2, 1) if v <= vmax and prod(ys) % v == 0)
    if v > 1 and ys[3] % v == 0:
        points.append(StripParams("flat", v))
        if isinstance(ctx.node.op, B.Involution):
            # each lane loads its own positions' kernels, so idle lanes of the rows layout are
            # paid in full: RedNet's 16x64x56x56 3x3 on H200, flat vec 4 21.6 us against rows
            # vec 2 / 4 25.0 / 30.9 us, which the cost model ranks equal or better
            points = [q for q in points if q.layout == "flat"]
    out = []
    for p in points:
        c = Candidate(_name(ctx), p, ctx, _build)
        if builds(c):
            out.append(c)
    return out


@dataclass(frozen=True)
class _Tiling:
    """Where a unit's lanes sit in the output: `r` the row (over n, c, oh) of the lane's
    outputs, `ow0` its first output column, `ow` element (u, i, j)'s column and `out` its flat
    output index."""
    units: int
    r: Expr
    ow0: Expr
    ow: Expr
    out: Expr
    tail: Expr | None        # the element's output exists
    lane_tail: Expr | None   # the lane's first output exists (its chunks feed all its outputs)


def _rows_tiling(g: _Conv, W: int, vec: int) -> _Tiling:
    nch = -(-g.OW // W)
    r, ow = U // nch, (U % nch) * W + J
    ow0 = ow - J % vec
    return _Tiling(g.N * g.Cout * g.OH * nch, r, ow0, ow, r * g.OW + ow, ow.lt(g.OW) if g.OW % W else None,
                   ow0.lt(g.OW) if g.OW % W else None)


def _flat_tiling(g: _Conv, W: int, vec: int) -> _Tiling:
    total = g.N * g.Cout * g.OH * g.OW
    f, f0 = U * W + J, U * W + (J // vec) * vec
    return _Tiling(-(-total // W), f0 // g.OW, f0 % g.OW, f0 % g.OW + J % vec, f, f.lt(total) if total % W else None,
                   f0.lt(total) if total % W else None)


def _build(ctx: Ctx, p: StripParams):
    g = _conv(ctx)
    vec, L = p.vec, ctx.lanes
    W = L * vec
    t = (_flat_tiling if p.layout == "flat" else _rows_tiling)(g, W, vec)
    x, y = ctx.node.inputs[0], ctx.node.outputs[0]
    acc = reg_dtype(ctx.tensors[y].dtype)
    xdt = reg_dtype(ctx.tensors[x].dtype)
    em = Emitter(ctx)
    K = g.KH * g.KW
    rw, rbias = _weights(em, ctx, g, t, K, W, vec)
    win = em.reg("win", K, W, xdt, vec)
    for kh in range(g.KH):
        for q in g.chunks(vec):
            chunk = _load_chunk(em, g, x, t, kh, q, vec, W, xdt)
            _window_from_chunk(em, g, chunk, win, kh, q, vec, W, xdt)
    prod_r = em.reg("prod", K, W, acc, vec)
    em.op(Elementwise("mul"), [MemorySlice.strided(win.buffer, Level.REGISTER, 0, K, W, W, xdt, vec), rw], [prod_r])
    seen = MemorySlice.strided(prod_r.buffer, Level.REGISTER, 0, K, W, W, acc, vec, t.tail)
    if K > 1:
        part = em.reg("part", 1, W, acc, vec)
        em.op(Reduce("sum", "num"), [seen], [part])
        seen = part
    if rbias is not None:
        tot = em.reg("out", 1, W, acc, vec)
        em.op(Elementwise("add"), [seen, rbias], [tot])
        seen = tot
    em.op(Move(), [seen], [em.gslice(y, t.out, 1, W, vec, t.tail)])
    return em.graph(Parallel(t.units, ctx.upg, L), _name(ctx))


def _name(ctx: Ctx) -> str:
    return "involution.strip" if isinstance(ctx.node.op, B.Involution) else "conv.depthwise.strip"


def _weights(em: Emitter, ctx: Ctx, g: _Conv, t: _Tiling, K: int, W: int, vec: int):
    """The KH x KW weights (and the bias) of each lane's channel as K x W (1 x W) register tiles.
    Rows layout: one channel per unit, loaded once and broadcast. Flat: a unit's lanes may span
    two channels; each lane loads its channel's (the vec columns of a lane share one address,
    which the compiler loads once)."""
    w = ctx.node.inputs[1]
    if isinstance(ctx.node.op, B.Involution):
        return _position_kernels(em, ctx, g, t, K, W, vec), None
    bias = ctx.node.inputs[2] if len(ctx.node.inputs) > 2 else None
    co = (t.r // g.OH) % g.Cout
    if "j" not in variables(co):
        from powerfusion.templates.ops_matmul import _conv_product
        pr = _conv_product(ctx)
        out_dims = tuple(range(pr.n_out))
        pieces = [(t.r, out_dims[:-1]), (t.ow0 + J % vec, out_dims[-1:]), (I, tuple(range(pr.n_out, len(pr.space))))]
        rw = load(em, pr.b, pieces, pr.space, K, W, vec, t.tail, "w")
        rbias = load(em, pr.bias, pieces[:2], pr.space[:pr.n_out], 1, W, vec, t.tail, "bias") if bias else None
        return rw, rbias
    rw = em.reg("w", K, W, reg_dtype(ctx.tensors[w].dtype), vec)
    em.op(Move(), [em.gslice(w, co * K + I, K, W, 1, t.tail)], [rw])
    if bias is None:
        return rw, None
    rbias = em.reg("bias", 1, W, reg_dtype(ctx.tensors[bias].dtype), vec)
    em.op(Move(), [em.gslice(bias, co, 1, W, 1, t.tail)], [rbias])
    return rw, rbias


def _position_kernels(em: Emitter, ctx: Ctx, g: _Conv, t: _Tiling, K: int, W: int, vec: int) -> MemorySlice:
    """An involution's K taps of each output position's kernel as a K x W register tile, one
    vector load per tap and lane: a lane's vec outputs are consecutive positions of one row
    (flat layout: OW % vec == 0; rows layout: consecutive in j), so their kernels are
    consecutive too (a vector slice's index is evaluated at the lane's first element). One
    element each otherwise."""
    from powerfusion.templates.ops_matmul import _involution_product
    pr = _involution_product(ctx)
    out_dims, red_dims = tuple(range(pr.n_out)), tuple(range(pr.n_out, len(pr.space)))
    pieces = [(t.r, out_dims[:-1]), (t.ow, out_dims[-1:]), (I, red_dims)]
    cs = coords(pieces, pr.space)
    index = pr.b.index(cs)
    gvec = vec if g.OW % vec == 0 or affine_coefficient(index, "j") == 1 else 1
    rw = em.reg("w", K, W, reg_dtype(ctx.tensors[pr.b.tensor].dtype), vec)
    em.op(Move(), [em.gslice(pr.b.tensor, index, K, W, gvec, t.tail)], [rw])
    return rw


def _load_chunk(em: Emitter, g: _Conv, x: str, t: _Tiling, kh: int, q: int, vec: int, W: int,
                dt: str) -> MemorySlice:
    """GLOBAL -> REGISTER: input row oh*sh + kh*dh - ph of the lane's channel plane, chunk q:
    columns ow0*sw + q*vec + (J % vec), padding as zeros. With stride 1 and the input the
    output's size the index is the output's flat index plus a constant (one vector access per
    lane); the masks test whole chunks where the row length is a multiple of vec."""
    plane, oh = t.r // g.OH, t.r % g.OH
    mult = g.Cout // g.C
    in_plane = plane if mult == 1 else (plane // g.Cout) * g.C + (plane % g.Cout) // mult
    ih = oh * g.sh + (kh * g.dh - g.ph)
    col0 = t.ow0 * g.sw + q * vec
    same = mult == 1 and g.sh == g.sw == 1 and (g.IH, g.IW) == (g.OH, g.OW)
    col = t.ow + q * vec if g.sw == 1 else col0 + J % vec    # element j's column, contiguous in j where it can be
    index = t.out + (kh * g.dh - g.ph) * g.IW + q * vec if same else (in_plane * g.IH + ih) * g.IW + col
    valid = t.lane_tail
    if g.ph or (g.OH - 1) * g.sh + (g.KH - 1) * g.dh - g.ph >= g.IH:
        valid = and_(valid, in_range(ih, 0, g.IH))
    whole = g.sw == 1 and g.IW % vec == 0
    valid = and_(valid, in_range(col0 if whole else col, 0, g.IW))
    src = em.gslice(x, index, 1, W, vec if g.sw == 1 else 1, valid, 0.0)
    reg = em.reg(f"x{kh}_{q - g.chunks(vec).start}", 1, W, dt, vec)
    em.op(Move(), [src], [reg])
    return reg


def _window_from_chunk(em: Emitter, g: _Conv, chunk: MemorySlice, win: MemorySlice, kh: int, q: int, vec: int,
                       W: int, dt: str) -> None:
    """Register -> register within each lane: window row kh, tap kw, output column v of the
    lane reads input column p = v*sw + kw*dw - pw past its first; those in chunk q (p // vec ==
    q) come from the chunk's element p % vec."""
    v = J % vec
    pcol = v * g.sw + I * g.dw - g.pw
    mine = (pcol // vec).eq(q)
    src = MemorySlice(chunk.buffer, Level.REGISTER, J - v + pcol - q * vec, g.KW, W, dt, vec, mine)
    dst = MemorySlice(win.buffer, Level.REGISTER, (I + kh * g.KW) * W + J, g.KW, W, dt, vec, mine)
    em.op(Move(), [src], [dst])
