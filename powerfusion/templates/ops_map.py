"""Candidates of the map-shaped basic ops (see maps.py): each op is described as
parts (iteration space, sources, destination) and offered under every tiling."""
from __future__ import annotations

from functools import partial

from powerfusion import basic as B
from powerfusion.gir.expr import Expr, Load, const, select, emin, emax
from powerfusion.templates.common import (builds, Candidate, Ctx, View, and_, contiguous_strides,
                                          contiguous_view, fill_value, in_range, wrap_clamp)
from powerfusion.templates.maps import Part, Source, TileParams, build_parts, map_tilings, vecs_for


def _offer(ctx: Ctx, name: str, parts_fn, space, tensors, kinds=("rows", "chunk", "cyclic"), splits=None):
    """Candidates for every feasible tiling of `space` (infeasible points are dropped)."""
    hint = ctx.target.groups_concurrent * ctx.upg * 4
    out = []
    for tp in map_tilings(space, vecs_for(ctx, tensors), ctx.lanes, hint, kinds, splits, ctx.upg, wide=True):
        c = Candidate(f"{name}.{tp.kind}", tp, ctx, partial(_build, parts_fn, f"{name}.{tp.kind}"))
        if builds(c):
            out.append(c)
    return out


def _build(parts_fn, template, ctx: Ctx, tp: TileParams):
    return build_parts(ctx, tp, parts_fn(ctx), template)


# ---- elementwise, broadcast, reshape -------------------------------------------------

def elementwise(ctx: Ctx) -> list[Candidate]:
    op: B.Elementwise = ctx.node.op
    out = ctx.node.outputs[0]
    shape = ctx.tensors[out].shape
    for t in ctx.node.inputs:
        if ctx.tensors[t].shape != shape:
            raise ctx.error(f"elementwise input '{t}' has shape {ctx.tensors[t].shape}, output {shape} "
                            "(broadcasts must be explicit)")

    def parts(ctx):
        srcs = tuple(Source(t, contiguous_view(shape)) for t in ctx.node.inputs)
        return [Part(shape, srcs, out, contiguous_view(shape), op.fn, op.params)]
    return _offer(ctx, "elementwise", parts, shape, list(ctx.node.inputs) + [out])


def broadcast_view(in_shape, out_shape) -> View:
    """numpy broadcasting: align right, size-1 (or missing) input dims get stride 0."""
    st = contiguous_strides(in_shape)
    lead = len(out_shape) - len(in_shape)
    lin = []
    for d in range(len(out_shape)):
        k = d - lead
        lin.append(0 if k < 0 or in_shape[k] == 1 else st[k])
    return View(tuple(lin))


def broadcast(ctx: Ctx) -> list[Candidate]:
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    shape = ctx.tensors[out].shape

    def parts(ctx):
        return [Part(shape, (Source(x, broadcast_view(ctx.tensors[x].shape, shape)),), out, contiguous_view(shape))]
    return _offer(ctx, "broadcast", parts, shape, [x, out])


def reshape(ctx: Ctx) -> list[Candidate]:
    """A copy with the identical flat pattern on both sides (merge 1 removes it after fusion;
    the lowering aliases the buffer instead where it can)."""
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    shape = ctx.tensors[out].shape

    def parts(ctx):
        return [Part(shape, (Source(x, contiguous_view(shape)),), out, contiguous_view(shape))]
    return _offer(ctx, "reshape", parts, shape, [x, out])


# ---- transpose (direct) --------------------------------------------------------------

def transpose_direct(ctx: Ctx) -> list[Candidate]:
    perm = ctx.node.op.perm
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    ishape, oshape = ctx.tensors[x].shape, ctx.tensors[out].shape
    ist, ost = contiguous_strides(ishape), contiguous_strides(oshape)

    def over_out(ctx):  # contiguous writes, strided reads
        return [Part(oshape, (Source(x, View(tuple(ist[p] for p in perm))),), out, View(ost))]

    def over_in(ctx):   # contiguous reads, strided writes
        inv = [perm.index(e) for e in range(len(perm))]
        return [Part(ishape, (Source(x, View(ist)),), out, View(tuple(ost[inv[e]] for e in range(len(perm)))))]
    return (_offer(ctx, "transpose.direct_out", over_out, oshape, [x, out])
            + _offer(ctx, "transpose.direct_in", over_in, ishape, [x, out]))


# ---- slice, concat --------------------------------------------------------------------

def slice_(ctx: Ctx) -> list[Candidate]:
    op: B.Slice = ctx.node.op
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    oshape = ctx.tensors[out].shape
    ist = contiguous_strides(ctx.tensors[x].shape)
    base = sum(int(s) * st for s, st in zip(op.starts, ist))
    view = View(tuple(st * int(step) for st, step in zip(ist, op.steps)), base)

    def parts(ctx):
        return [Part(oshape, (Source(x, view),), out, contiguous_view(oshape))]
    return _offer(ctx, "slice", parts, oshape, [x, out])


def concat(ctx: Ctx) -> list[Candidate]:
    """By input: each input's elements copied to its region of the output (parts in sequence);
    the rows variant with one unit per output row is in concat_rows (rows align with inputs)."""
    axis = ctx.node.op.axis
    out = ctx.node.outputs[0]
    oshape = ctx.tensors[out].shape
    ost = contiguous_strides(oshape)

    def parts(ctx):
        res, off = [], 0
        for t in ctx.node.inputs:
            s = ctx.tensors[t].shape
            res.append(Part(s, (Source(t, contiguous_view(s)),), out, View(ost, off * ost[axis])))
            off += s[axis]
        return res
    first = ctx.tensors[ctx.node.inputs[0]].shape
    return _offer(ctx, "concat.by_input", parts, first, list(ctx.node.inputs) + [out])


# ---- pad, window, gather ---------------------------------------------------------------

def pad(ctx: Ctx) -> list[Candidate]:
    op: B.Pad = ctx.node.op
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    ishape, oshape = ctx.tensors[x].shape, ctx.tensors[out].shape
    ist = contiguous_strides(ishape)
    dims = [d for d in range(len(ishape)) if op.begins[d] or op.ends[d]]
    if op.mode == "constant":
        src = Source(x, View(ist, -sum(b * s for b, s in zip(op.begins, ist))),
                     valid=lambda cs: _all(in_range(cs[d] - op.begins[d], 0, ishape[d]) for d in dims),
                     fill=fill_value(ctx.tensors[x].dtype, op.value))
    elif op.mode in ("edge", "reflect"):
        src = Source(x, index=lambda cs: _padded_index(cs, op, ishape, ist))
    else:
        raise ctx.error(f"pad mode '{op.mode}' has no template")

    def parts(ctx):
        return [Part(oshape, (src,), out, contiguous_view(oshape))]
    return _offer(ctx, "pad", parts, oshape, [x, out])


def _all(conds) -> Expr | None:
    acc = None
    for c in conds:
        acc = and_(acc, c)
    return acc


def _padded_index(cs, op: B.Pad, ishape, ist) -> Expr:
    """edge / reflect: crop (negative pads) then map each coordinate back into the input."""
    total = const(0)
    for d, (n, st) in enumerate(zip(ishape, ist)):
        lo, hi = max(-op.begins[d], 0), max(-op.ends[d], 0)
        m = n - lo - hi                       # extent after cropping
        p = cs[d] - max(op.begins[d], 0)      # position in the cropped input, may be outside
        if op.mode == "edge":
            q = emin(emax(p, 0), m - 1)
        else:
            q = select(p.lt(0), const(0) - p, select(p.lt(m), p, 2 * (m - 1) - p))
        total = total + (q + lo) * st
    return total


def window(ctx: Ctx) -> list[Candidate]:
    op: B.Window = ctx.node.op
    x, out = ctx.node.inputs[0], ctx.node.outputs[0]
    ishape, oshape = ctx.tensors[x].shape, ctx.tensors[out].shape
    ist = contiguous_strides(ishape)
    ns = len(op.kernel)
    sp = 1 if op.channels_last else 2     # the first spatial axis of input and output
    spatial = [ist[sp + d] for d in range(ns)]
    lin = [op.strides[d] * spatial[d] for d in range(ns)] + [op.dilations[d] * spatial[d] for d in range(ns)]
    lin = [ist[0], *lin, ist[-1]] if op.channels_last else [ist[0], ist[1], *lin]
    base = -sum(op.pad_begins[d] * spatial[d] for d in range(ns))
    padded = [d for d in range(ns) if op.pad_begins[d] or op.pad_ends[d]]

    def valid(cs):
        return _all(in_range(cs[sp + d] * op.strides[d] + cs[sp + ns + d] * op.dilations[d] - op.pad_begins[d], 0,
                             ishape[sp + d]) for d in padded)
    src = Source(x, View(tuple(lin), base), valid=valid, fill=fill_value(ctx.tensors[x].dtype, op.pad_value))

    def parts(ctx):
        return [Part(oshape, (src,), out, contiguous_view(oshape))]
    return _offer(ctx, "window", parts, oshape, [x, out])


def gather(ctx: Ctx) -> list[Candidate]:
    axis = ctx.node.op.axis
    data, idx = ctx.node.inputs[:2]
    out = ctx.node.outputs[0]
    dshape, ishape, oshape = ctx.tensors[data].shape, ctx.tensors[idx].shape, ctx.tensors[out].shape
    dst, ist = contiguous_strides(dshape), contiguous_strides(ishape)
    ri = len(ishape)
    ibuf = ctx.names[idx]

    def index(cs):
        flat = sum((c * s for c, s in zip(cs[axis:axis + ri], ist)), const(0))
        g = wrap_clamp(Load(ibuf, flat), dshape[axis])
        pre = sum((c * s for c, s in zip(cs[:axis], dst[:axis])), const(0))
        post = sum((c * s for c, s in zip(cs[axis + ri:], dst[axis + 1:])), const(0))
        return pre + g * dst[axis] + post

    def parts(ctx):
        return [Part(oshape, (Source(data, index=index),), out, contiguous_view(oshape))]
    return _offer(ctx, "gather", parts, oshape, [data, out])


def gather_elements(ctx: Ctx) -> list[Candidate]:
    axis = ctx.node.op.axis
    data, idx = ctx.node.inputs[:2]
    out = ctx.node.outputs[0]
    dshape, oshape = ctx.tensors[data].shape, ctx.tensors[out].shape
    dst, ost = contiguous_strides(dshape), contiguous_strides(oshape)
    ibuf = ctx.names[idx]

    def index(cs):
        flat = sum((c * s for c, s in zip(cs, ost)), const(0))
        g = wrap_clamp(Load(ibuf, flat), dshape[axis])
        return sum((g * dst[d] if d == axis else c * dst[d] for d, c in enumerate(cs)), const(0))

    def parts(ctx):
        return [Part(oshape, (Source(data, index=index),), out, contiguous_view(oshape))]
    return _offer(ctx, "gather_elements", parts, oshape, [data, out])
