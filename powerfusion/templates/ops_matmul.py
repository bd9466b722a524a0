"""Memory-bound MatMul (GEMV, small M, batched decode attention) and depthwise Conv as
broadcast-multiply-reduce. Both are a product of two operands over a space
[out dims..., reduced dims...], summed over the reduced dims:

* `dot`: one unit per output element; lanes walk the reduced dims (num x W), reduce over
  num then width. Coalesced when both operands are contiguous along the reduction
  (x @ W^T with W stored [N, K], the q.K^T of attention).
* `dot` with rows R > 1: a unit computes R consecutive outputs, one per segment, for short
  reductions (at most DOT_ROWS_K warp-wide segments): R times the loads per lane in flight,
  for decode attention's q.K^T (K = head size 64).
* `cols`: lanes over W consecutive outputs along the last output dim, num = the reduction;
  reduce over num, no lane exchange. Coalesced when the second operand is contiguous along
  the output dim (x @ W with W stored [K, N], probs @ V).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from powerfusion import basic as B
from powerfusion.gir.expr import Expr, I, J, U
from powerfusion.gir.ir import Elementwise, Level, MemorySlice, Move, Parallel, Reduce, Scope, Sync
from powerfusion.templates.common import (builds, Candidate, Ctx, Emitter, Infeasible, View, and_, contiguous_strides,
                                          in_range, prod, reg_dtype)
from powerfusion.templates.maps import Source, load


@dataclass(frozen=True)
class DotParams:
    style: str    # dot | cols
    vec: int = 1
    split: int = 1  # cols: units per output block, each summing a contiguous chunk of the reduction
    rows: int = 1   # dot: consecutive outputs per unit (one warp-wide segment each)


MAX_SPLIT = 512
DOT_ROWS = (4, 8)
DOT_ROWS_K = 4      # dot rows: at most this many warp-wide segments per output


def _splits(Kn: int) -> list[int]:
    """Split-K factors for a long reduction (decode attention's probs @ V over the KV cache):
    chunks of about 32 and 128 rows, so a unit's registers stay small and enough units run; at
    most MAX_SPLIT partials per output (the finisher holds them all in registers)."""
    if Kn < 512:
        return []
    return sorted({min(MAX_SPLIT, -(-Kn // rows)) for rows in (32, 128)})


def _vecs(vmax: int, lanes: int, extent: int, whole: bool = False) -> list[int]:
    """The widest vector whose lanes x vec fits `extent` (no idle lanes), and scalar. With
    `whole`, also the widest vector that divides an extent wider than a warp but narrower
    than lanes x vmax: one unit then covers the whole extent (idle lanes at its end), so its
    units line up with a map over rows of that extent and the two can share a kernel (a
    depthwise conv and the BatchNorm + activation after it)."""
    fit = [v for v in (8, 4, 2, 1) if v <= vmax and (lanes * v <= extent or v == 1)]
    out = [fit[0], 1]
    if whole and lanes < extent < lanes * vmax:
        out.insert(1, max(v for v in (8, 4, 2, 1) if v <= vmax and extent % v == 0))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Product:
    """y[out] = sum over red of a[out, red] * b[out, red] (+ bias[out])."""
    space: tuple[int, ...]      # out dims then reduced dims
    n_out: int
    a: Source
    b: Source
    bias: Source | None = None


def _offer(ctx: Ctx, name: str, prod_fn) -> list[Candidate]:
    size = max(ctx.tensors[t].dtype.itemsize for t in list(ctx.node.inputs) + list(ctx.node.outputs))
    vmax = max(v for v in (8, 4, 2, 1) if v * size <= 16)
    out = []
    pr = prod_fn(ctx)
    Kn = prod(pr.space[pr.n_out:])
    L = pr.space[pr.n_out - 1] if pr.n_out else 1
    dot_v, col_v = _vecs(vmax, ctx.lanes, Kn), _vecs(vmax, ctx.lanes, L, whole=name in ("conv.depthwise", "involution"))
    n_outputs = prod(pr.space[:pr.n_out])
    # several outputs per unit only where that still leaves a unit per warp slot of the device
    rows = [DotParams("dot", v, rows=r) for v in dot_v if Kn % (ctx.lanes * v) == 0 and Kn <= DOT_ROWS_K * ctx.lanes * v
            for r in DOT_ROWS if n_outputs >= r * ctx.target.groups_concurrent * ctx.upg]
    # first: the lowering's default descent starts from the first candidate, and a unit of
    # several short dots beats one dot per unit wherever it is offered
    points = sorted(rows, key=lambda q: (-q.rows, -q.vec)) + [DotParams("dot", v) for v in dot_v] + \
        [DotParams("cols", v) for v in col_v]
    if (Kn < ctx.lanes or (name in ("conv.depthwise", "involution") and Kn < 2 * ctx.lanes)) and L > 1:
        # a dot shorter than a warp leaves most lanes idle (a 3x3 depthwise window: 9 of 32,
        # measured 20x slower than cols, which the model did not see): cols only. A 7x7 window
        # (49 taps, two warp-wide segments gathered across 7 input rows) ran 1.7-6x slower than
        # cols at every ConvNeXt-T stage on H200 (benchmarks/results/gir-dwconv.md)
        points = [q for q in points if q.style != "dot"]
    splits = _splits(Kn)
    if splits and Kn > 2048:   # unsplit cols would hold the whole reduction per lane: split only
        points = [q for q in points if q.style != "cols"]
    points += [DotParams("cols", v, s) for s in splits for v in col_v]
    for p in points:
        c = Candidate(f"{name}.{p.style}", p, ctx, partial(_build, prod_fn, f"{name}.{p.style}"))
        if builds(c):
            out.append(c)
    return out


def _build(prod_fn, template, ctx: Ctx, p: DotParams):
    pr: Product = prod_fn(ctx)
    y = ctx.node.outputs[0]
    shape, n_out = pr.space, pr.n_out
    out_dims, red_dims = tuple(range(n_out)), tuple(range(n_out, len(shape)))
    Kn = prod([shape[d] for d in red_dims])
    W = ctx.lanes * p.vec
    em = Emitter(ctx)
    acc = reg_dtype(ctx.tensors[y].dtype)
    if p.style == "dot" and p.rows > 1:
        n_total, num = prod(shape[:n_out]), p.rows
        out_index = U * num + I
        out_tail = out_index.lt(n_total) if n_total % num else None
        units, out_w = -(-n_total // num), 1
        seen = _dot_rows(em, pr, shape, out_dims, red_dims, out_index, out_tail, num, W, p.vec, acc)
    elif p.style == "dot":
        num = max(1, -(-Kn // W))
        k = I * W + J
        pieces = [(U, out_dims), (k, red_dims)]
        tail = k.lt(Kn) if num * W != Kn else None
        units, out_index, out_tail, out_w = prod(shape[:n_out]), U, None, 1
    else:
        L = shape[n_out - 1]
        if L == 1:
            raise Infeasible("cols needs a last output dim > 1")
        nch = -(-L // W)
        S = p.split
        ub = U // S if S > 1 else U             # the output block this unit sums for
        lane = (ub % nch) * W + J
        num = -(-Kn // S)
        k = (U % S) * num + I if S > 1 else I   # this unit's chunk of the reduction
        pieces = [(ub // nch, out_dims[:-1]), (lane, out_dims[-1:]), (k, red_dims)]
        out_tail = lane.lt(L) if L % W else None
        tail = and_(out_tail, k.lt(Kn) if num * S != Kn else None)
        units, out_index, out_w = prod(shape[:n_out - 1]) * nch * S, (ub // nch) * L + lane, W
    if p.rows == 1:
        ra = load(em, pr.a, pieces, shape, num, W, p.vec, tail, "a")
        rb = load(em, pr.b, pieces, shape, num, W, p.vec, tail, "b")
        prod_r = em.reg("prod", num, W, acc, p.vec)
        em.op(Elementwise("mul"), [ra, rb], [prod_r])
        seen = MemorySlice.strided(prod_r.buffer, Level.REGISTER, 0, num, W, W, acc, p.vec, tail)
    if num > 1 and p.rows == 1:
        part = em.reg("part", 1, W, acc, p.vec)
        em.op(Reduce("sum", "num"), [seen], [part])
        seen = part
    if p.style == "dot":
        s = em.reg("sum", p.rows, 1, acc)
        em.op(Reduce("sum", "width"), [seen], [s])
        seen = s
    if p.style == "cols" and p.split > 1:
        # partials [split, outputs] in a GLOBAL scratch, a DEVICE sync, then one unit per
        # output block sums its `split` partials (coalesced: W outputs per row of partials)
        S, n_total = p.split, prod(shape[:n_out])
        scratch = em.local("partials", Level.GLOBAL, S * n_total, acc)
        gw = MemorySlice(scratch, Level.GLOBAL, (U % S) * n_total + out_index, 1, W, acc, p.vec, out_tail)
        em.op(Move(), [seen], [gw])
        fin_units = prod(shape[:n_out - 1]) * nch
        fin_index = (U // nch) * L + (U % nch) * W + J
        fin_tail = ((U % nch) * W + J).lt(L) if L % W else None
        gr = MemorySlice(scratch, Level.GLOBAL, I * n_total + fin_index, S, W, acc, p.vec, fin_tail)
        em.op(Sync(Scope.DEVICE), [gw], [gr])
        fin = U.lt(fin_units)
        q = em.reg("q", S, W, acc, p.vec)
        em.op(Move(), [gr], [q], fin)
        part2 = em.reg("fin_part", 1, W, acc, p.vec)
        em.op(Reduce("sum", "num"), [MemorySlice.strided(q.buffer, Level.REGISTER, 0, S, W, W, acc, p.vec, fin_tail)],
              [part2], fin)
        seen, out_index, out_tail = part2, fin_index, fin_tail
        pieces = [(U // nch, out_dims[:-1]), ((U % nch) * W + J, out_dims[-1:])]
        guard = fin
    else:
        guard = None
    if pr.bias is not None:
        bias_pieces = [(out_index, out_dims)] if p.style == "dot" else pieces[:2]
        rbias = load(em, pr.bias, bias_pieces, shape[:n_out], p.rows, out_w, p.vec if out_w > 1 else 1, out_tail,
                     "bias", guard)
        tot = em.reg("out", p.rows, out_w, acc, p.vec if out_w > 1 else 1)
        em.op(Elementwise("add"), [seen, rbias], [tot], guard)
        seen = tot
    vec = p.vec if out_w > 1 else 1
    em.op(Move(), [seen], [em.gslice(y, out_index, p.rows, out_w, vec, out_tail)], guard)
    return em.graph(Parallel(max(units, 1), ctx.upg, ctx.lanes), template)


def _dot_rows(em: Emitter, pr: Product, shape, out_dims, red_dims, out_index, out_tail, num, W, vec, acc):
    """`num` outputs per unit, segment i of the tile = output U*num + i; a reduction of
    segs x W elements is loaded as segs separate num x W tiles whose products are added
    (whole register buffers only), then each row is summed across the lanes."""
    segs = prod([shape[d] for d in red_dims]) // W
    seen = None
    for sg in range(segs):
        pieces = [(out_index, out_dims), (J + sg * W, red_dims)]
        ra = load(em, pr.a, pieces, shape, num, W, vec, out_tail, f"a{sg}")
        rb = load(em, pr.b, pieces, shape, num, W, vec, out_tail, f"b{sg}")
        prod_r = em.reg(f"prod{sg}", num, W, acc, vec)
        em.op(Elementwise("mul"), [ra, rb], [prod_r])
        if seen is not None:
            tot = em.reg(f"acc{sg}", num, W, acc, vec)
            em.op(Elementwise("add"), [seen, prod_r], [tot])
            prod_r = tot
        seen = prod_r
    return MemorySlice.strided(seen.buffer, Level.REGISTER, 0, num, W, W, acc, vec, out_tail)


# ---- MatMul ----------------------------------------------------------------------------

def _matmul_product(ctx: Ctx) -> Product:
    op: B.MatMul = ctx.node.op
    a, b = ctx.node.inputs[:2]
    sa, sb = ctx.tensors[a].shape, ctx.tensors[b].shape
    ta, tb = contiguous_strides(sa), contiguous_strides(sb)
    if len(sa) == 1:
        M, K, am, ak, abatch = 1, sa[0], 0, ta[0], ()
    else:
        M, K = (sa[-1], sa[-2]) if op.trans_a else (sa[-2], sa[-1])
        am, ak = (ta[-1], ta[-2]) if op.trans_a else (ta[-2], ta[-1])
        abatch = sa[:-2]
    if len(sb) == 1:
        N, bk, bn, bbatch = 1, tb[0], 0, ()
    else:
        N = sb[-2] if op.trans_b else sb[-1]
        bk, bn = (tb[-1], tb[-2]) if op.trans_b else (tb[-2], tb[-1])
        bbatch = sb[:-2]
    nb = max(len(abatch), len(bbatch))
    batch = tuple(max(x, y) for x, y in zip((1,) * (nb - len(abatch)) + tuple(abatch),
                                            (1,) * (nb - len(bbatch)) + tuple(bbatch)))

    def batch_lin(bshape, strides):
        lead = nb - len(bshape)
        return tuple(0 if d < lead or bshape[d - lead] == 1 else strides[d - lead] for d in range(nb))
    space = batch + (M, N, K)
    va = View(batch_lin(abatch, ta[:-2] if len(sa) > 1 else ()) + (am, 0, ak))
    vb = View(batch_lin(bbatch, tb[:-2] if len(sb) > 1 else ()) + (0, bn, bk))
    if prod(space[:-1]) != ctx.tensors[ctx.node.outputs[0]].size:
        raise ctx.error(f"matmul output {ctx.tensors[ctx.node.outputs[0]].shape} does not match {space[:-1]}")
    return Product(space, nb + 2, Source(a, va), Source(b, vb))


def matmul(ctx: Ctx) -> list[Candidate]:
    return _offer(ctx, "matmul", _matmul_product)


# ---- depthwise Conv ---------------------------------------------------------------------

def _conv_product(ctx: Ctx) -> Product:
    """A depthwise conv as a product over [N, Cout, *O, *K], or, channels-last
    (frontend/layout.py: x [N, *I, C], w [Cout, *K, 1], y [N, *O, Cout]), over [N, *O, Cout, *K]:
    the channel is then the last output dim, so a unit's lanes run along C and read x's window
    rows contiguously (cols, vectorised over C)."""
    op: B.Conv = ctx.node.op
    x, w = ctx.node.inputs[:2]
    xs, ws = ctx.tensors[x].shape, ctx.tensors[w].shape
    ys = ctx.tensors[ctx.node.outputs[0]].shape
    ns, cl = len(xs) - 2, op.channels_last
    C, Cout = (xs[-1] if cl else xs[1]), ws[0]
    mult = Cout // C
    xst, wst = contiguous_strides(xs), contiguous_strides(ws)
    sp = 1 if cl else 2                           # x's, y's and w's first spatial / kernel axis
    c_dim, o_dim, k_dim = (1 + ns, 1, 2 + ns) if cl else (1, 2, 2 + ns)   # in the product space
    x_c = xst[-1] if cl else xst[1]
    osz, ksz = tuple(ys[sp:sp + ns]), tuple(ws[sp:sp + ns])
    space = (ys[0],) + ((*osz, Cout) if cl else (Cout, *osz)) + ksz

    def x_index(cs) -> Expr:
        c = cs[c_dim]
        e = cs[0] * xst[0] + (c // mult if mult > 1 else c) * x_c
        for d in range(ns):
            e = e + (cs[o_dim + d] * op.strides[d] + cs[k_dim + d] * op.dilations[d] - op.pad_begins[d]) * xst[sp + d]
        return e

    padded = [d for d in range(ns) if op.pad_begins[d] or op.pad_ends[d]]

    def x_valid(cs):
        acc = None
        for d in padded:
            acc = and_(acc, in_range(cs[o_dim + d] * op.strides[d] + cs[k_dim + d] * op.dilations[d] - op.pad_begins[d],
                                     0, xs[sp + d]))
        return acc

    def along_c(c_stride: int, k_strides=(0,) * ns) -> View:
        lin = [0] * len(space)
        lin[c_dim] = c_stride
        lin[k_dim:] = k_strides
        return View(tuple(lin))
    bias = Source(ctx.node.inputs[2], along_c(1)) if len(ctx.node.inputs) > 2 else None
    return Product(space, 2 + ns, Source(x, index=x_index, valid=x_valid), Source(w, along_c(wst[0], wst[sp:sp + ns])),
                   bias)


def _involution_product(ctx: Ctx) -> Product:
    """B.Involution as a product over [N, C, OH, OW, KH, KW]: the window of x (as a depthwise
    conv reads it) times the kernel of the output position and the channel's group."""
    op: B.Involution = ctx.node.op
    x, w = ctx.node.inputs[:2]
    xs, ws = ctx.tensors[x].shape, ctx.tensors[w].shape
    ys = ctx.tensors[ctx.node.outputs[0]].shape
    xst = contiguous_strides(xs)
    KH, KW = op.kernel
    OH, OW = ys[2:]
    cg = xs[1] // ws[1]
    space = (ys[0], xs[1], OH, OW, KH, KW)

    def x_index(cs) -> Expr:
        e = cs[0] * xst[0] + cs[1] * xst[1]
        for d in range(2):
            e = e + (cs[2 + d] * op.strides[d] + cs[4 + d] * op.dilations[d] - op.pad_begins[d]) * xst[2 + d]
        return e

    def x_valid(cs):
        acc = None
        for d in range(2):
            if op.pad_begins[d] or op.pad_ends[d]:
                acc = and_(acc, in_range(cs[2 + d] * op.strides[d] + cs[4 + d] * op.dilations[d] - op.pad_begins[d],
                                         0, xs[2 + d]))
        return acc

    def w_index(cs) -> Expr:
        group = cs[1] // cg if cg > 1 else cs[1]
        return (((cs[0] * ws[1] + group) * (KH * KW) + cs[4] * KW + cs[5]) * OH + cs[2]) * OW + cs[3]
    return Product(space, 4, Source(x, index=x_index, valid=x_valid), Source(w, index=w_index), None)


def involution(ctx: Ctx) -> list[Candidate]:
    """A window sum with a kernel per position (B.Involution): the cols / dot forms of a depthwise
    conv, whose weight load reads the position's kernel instead of the channel's."""
    return _offer(ctx, "involution", _involution_product)


def conv(ctx: Ctx) -> list[Candidate]:
    op: B.Conv = ctx.node.op
    x, w = ctx.node.inputs[:2]
    xs, ws = ctx.tensors[x].shape, ctx.tensors[w].shape
    c, per_group = (xs[-1], ws[-1]) if op.channels_last else (xs[1], ws[1])
    if not (op.group == c and per_group == 1 and ws[0] % c == 0):
        raise ctx.error("only depthwise convolutions (group = channels) are memory-bound GIR templates; "
                        "others go to a library")
    return _offer(ctx, "conv.depthwise", _conv_product)
