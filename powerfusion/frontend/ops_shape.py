"""Converters for data-movement ONNX ops: reshape family, transpose, concat, split,
slice, gather, expand, pad, and the ops that are constants once shapes are static."""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from powerfusion.basic import Concat, Gather, GatherElements, Pad, Slice
from powerfusion.frontend.builder import NodeCtx
from powerfusion.frontend.numpy_exec import bad_index


def convert_reshape(cx: NodeCtx):
    shape = cx.const_ints(1, "shape")
    src = cx.shape(0)
    allowzero = cx.attr("allowzero", 0)
    out = [src[i] if d == 0 and not allowzero else d for i, d in enumerate(shape)]
    if out.count(-1) > 1:
        cx.fail(f"shape {shape} has more than one -1")
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
        out[out.index(-1)] = int(np.prod(src, dtype=np.int64)) // max(known, 1)
    cx.reshape(cx.inp(0), out, out=cx.out())


def convert_flatten(cx: NodeCtx):
    src = cx.shape(0)
    axis = cx.attr("axis", 1)
    if not -len(src) <= axis <= len(src):
        cx.fail(f"axis {axis} is out of range for rank {len(src)}")
    axis = axis + len(src) if axis < 0 else axis  # range [-r, r]: -1 means r - 1
    outer = int(np.prod(src[:axis], dtype=np.int64))
    cx.reshape(cx.inp(0), (outer, int(np.prod(src[axis:], dtype=np.int64))), out=cx.out())


def _axes(cx: NodeCtx, input_index: int, since: int):
    return cx.const_ints(input_index, "axes") if cx.opset >= since else cx.attr("axes", None)


def convert_squeeze(cx: NodeCtx):
    src = cx.shape(0)
    axes = _axes(cx, 1, 13)
    if axes is None:
        axes = [i for i, d in enumerate(src) if d == 1]
    axes = {cx.axis(a, len(src)) for a in axes}
    if any(src[a] != 1 for a in axes):
        cx.fail(f"cannot squeeze axes {sorted(axes)} of shape {src}: not all are 1")
    cx.reshape(cx.inp(0), [d for i, d in enumerate(src) if i not in axes], out=cx.out())


def convert_unsqueeze(cx: NodeCtx):
    src = list(cx.shape(0))
    axes = _axes(cx, 1, 13)
    rank = len(src) + len(axes)
    axes = sorted(cx.axis(a, rank) for a in axes)
    for a in axes:
        src.insert(a, 1)
    cx.reshape(cx.inp(0), src, out=cx.out())


def convert_transpose(cx: NodeCtx):
    rank = len(cx.shape(0))
    perm = cx.attr("perm", None) or list(reversed(range(rank)))
    cx.transpose(cx.inp(0), [int(p) for p in perm], out=cx.out())


def convert_concat(cx: NodeCtx):
    names = [cx.inp(i) for i in range(cx.n_in()) if cx.has(i)]
    shapes = [cx.shape(n) for n in names]
    axis = cx.axis(cx.attr("axis"), len(shapes[0]))
    # zero-sized pieces contribute nothing
    kept = [(n, s) for n, s in zip(names, shapes) if s[axis] > 0] or [(names[0], shapes[0])]
    shape = list(kept[0][1])
    shape[axis] = sum(s[axis] for _, s in kept)
    if len(kept) == 1:
        cx.alias(kept[0][0], cx.out())
        return
    cx.emit(Concat(axis), [n for n, _ in kept], shape, cx.dtype(0), out=cx.out())


def _slice(cx: NodeCtx, name: str, axis: int, start: int, stop: int, out: str | None):
    shape = cx.shape(name)
    starts, stops, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[axis], stops[axis] = start, stop
    oshape = list(shape)
    oshape[axis] = stop - start
    return cx.emit(Slice(tuple(starts), tuple(stops), tuple(steps)), [name], oshape, cx.info(name).dtype, out)


def convert_split(cx: NodeCtx):
    shape = cx.shape(0)
    axis = cx.axis(cx.attr("axis", 0), len(shape))
    n = len(cx.node.output)
    sizes = cx.const_ints(1, "split") if cx.opset >= 13 else cx.attr("split", None)
    if not sizes:
        if cx.opset >= 18 and cx.attr("num_outputs", None):
            n = cx.attr("num_outputs")
        chunk = -(-shape[axis] // n)  # ceil: the last piece may be smaller (opset 18)
        sizes = [min(chunk, shape[axis] - i * chunk) for i in range(n)]
    if sum(sizes) != shape[axis] or len(sizes) != len(cx.node.output):
        cx.fail(f"split sizes {sizes} do not cover axis {axis} of size {shape[axis]} in {len(cx.node.output)} outputs")
    start = 0
    for i, size in enumerate(sizes):
        if cx.out(i):
            _slice(cx, cx.inp(0), axis, start, start + size, cx.out(i))
        start += size


def convert_slice(cx: NodeCtx):
    shape = cx.shape(0)
    starts_in, ends_in = cx.const_ints(1, "starts"), cx.const_ints(2, "ends")
    axes = cx.const_ints(3, "axes") or list(range(len(starts_in)))
    steps_in = cx.const_ints(4, "steps") or [1] * len(starts_in)
    starts, stops, steps = [0] * len(shape), list(shape), [1] * len(shape)
    oshape = list(shape)
    for a, b, e, s in zip(axes, starts_in, ends_in, steps_in):
        a = cx.axis(a, len(shape))
        if s == 0:
            cx.fail("slice step 0")
        b, e = _clamp_slice(b, e, s, shape[a])
        oshape[a] = len(range(b, e, s))
        starts[a], stops[a], steps[a] = b, (None if s < 0 and e < 0 else e), s
    cx.emit(Slice(tuple(starts), tuple(stops), tuple(steps)), [cx.inp(0)], oshape, cx.dtype(0), out=cx.out())


def _clamp_slice(start: int, end: int, step: int, dim: int) -> tuple[int, int]:
    """ONNX's clamping (not Python's: a negative step clamps start to dim - 1, not to -1)."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return min(max(start, 0), dim), min(max(end, 0), dim)
    return min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)


def convert_gather(cx: NodeCtx):
    data, ind = cx.shape(0), cx.shape(1)
    axis = cx.axis(cx.attr("axis", 0), len(data))
    _check_constant_indices(cx, data[axis])
    shape = data[:axis] + ind + data[axis + 1:]
    idx = cx.const(1)
    if idx is not None and np.ndim(idx) == 0:
        _select(cx, cx.inp(0), axis, int(idx) % data[axis], shape)
        return
    cx.emit(Gather(axis), [cx.inp(0), cx.inp(1)], shape, cx.dtype(0), out=cx.out())


def _select(cx: NodeCtx, data: str, axis: int, i: int, shape) -> None:
    """Gather at one constant index: a Slice of extent 1 and a Reshape dropping the axis (a
    Slice is a plain strided read to the kernels; a Gather loads its index). Where the data is
    a Transpose (behind a Reshape that only drops or adds extent-1 axes), the slice is taken
    before the transpose, which then often moves extent-1 axes only and becomes a Reshape:
    ViT's unbind of its packed QKV (Transpose(3, 1, 2, 0, 4), squeeze, Gather 0 / 1 / 2)
    becomes three strided slices of the QKV rows."""
    src, src_axis, perm = _through_transpose(cx, data, axis)
    if perm is not None:
        x = cx.info(src).shape
        starts, stops = [0] * len(x), list(x)
        starts[src_axis], stops[src_axis] = i, i + 1
        sliced = cx.emit(Slice(tuple(starts), tuple(stops), (1,) * len(x)), [src],
                         tuple(1 if a == src_axis else d for a, d in enumerate(x)), cx.dtype(0))
        cx.reshape(cx.transpose(sliced, perm), shape, out=cx.out())
        return
    d = cx.info(data).shape
    starts, stops = [0] * len(d), list(d)
    starts[axis], stops[axis] = i, i + 1
    sliced = cx.emit(Slice(tuple(starts), tuple(stops), (1,) * len(d)), [data],
                     tuple(1 if a == axis else n for a, n in enumerate(d)), cx.dtype(0))
    cx.reshape(sliced, shape, out=cx.out())


def _through_transpose(cx: NodeCtx, data: str, axis: int):
    """(the Transpose's input, the axis of it that `axis` of `data` is, the perm) where `data` is
    a Transpose's output, or a Reshape of one that only drops or adds extent-1 axes; else
    (data, axis, None)."""
    from powerfusion.basic import Reshape, Transpose
    node = next((n for n in reversed(cx.b.nodes) if data in n.outputs), None)
    t_axis = axis
    if node is not None and isinstance(node.op, Reshape):
        inner = cx.info(node.inputs[0]).shape
        outer = cx.info(data).shape
        big_in = [a for a, n in enumerate(inner) if n != 1]
        big_out = [a for a, n in enumerate(outer) if n != 1]
        if [inner[a] for a in big_in] != [outer[a] for a in big_out] or axis not in big_out:
            return data, axis, None
        t_axis = big_in[big_out.index(axis)]
        node = next((n for n in reversed(cx.b.nodes) if node.inputs[0] in n.outputs), None)
    if node is None or not isinstance(node.op, Transpose):
        return data, axis, None
    return node.inputs[0], node.op.perm[t_axis], node.op.perm


def _check_constant_indices(cx: NodeCtx, n: int) -> None:
    idx = cx.const(1)
    if idx is not None and (bad := bad_index(idx, int(n))) is not None:
        cx.fail(f"constant index {bad} is out of range for an axis of size {n} (allowed [-{n}, {n - 1}])")


def convert_gather_elements(cx: NodeCtx):
    data = cx.shape(0)
    axis = cx.axis(cx.attr("axis", 0), len(data))
    _check_constant_indices(cx, data[axis])
    cx.emit(GatherElements(axis), [cx.inp(0), cx.inp(1)], cx.shape(1), cx.dtype(0), out=cx.out())


def convert_expand(cx: NodeCtx):
    target = cx.const_ints(1, "shape")
    try:
        shape = np.broadcast_shapes(cx.shape(0), tuple(target))
    except ValueError:
        cx.fail(f"cannot expand {cx.shape(0)} to {tuple(target)}")
    name = cx.inp(0)
    if shape == cx.shape(0):
        cx.alias(name, cx.out())
    else:
        from powerfusion.basic import Broadcast
        cx.emit(Broadcast(tuple(shape)), [name], shape, cx.dtype(0), out=cx.out())


def convert_tile(cx: NodeCtx):
    from powerfusion.basic import Broadcast
    shape = cx.shape(0)
    reps = cx.const_ints(1, "repeats")
    if len(reps) != len(shape) or min(reps, default=1) < 0:
        cx.fail(f"repeats {reps} do not match rank {len(shape)}")
    # [d0, d1] -> [1, d0, 1, d1] -> broadcast [r0, d0, r1, d1] -> [r0*d0, r1*d1]
    spread = cx.reshape(cx.inp(0), [v for d in shape for v in (1, d)])
    wide = tuple(v for r, d in zip(reps, shape) for v in (r, d))
    b = cx.emit(Broadcast(wide), [spread], wide, cx.dtype(0))
    cx.reshape(b, [r * d for r, d in zip(reps, shape)], out=cx.out())


def convert_depth_to_space(cx: NodeCtx):
    n, c, h, w = cx.shape(0)
    bs = int(cx.attr("blocksize"))
    if c % (bs * bs):
        cx.fail(f"channels {c} are not a multiple of blocksize^2 = {bs * bs}")
    if cx.attr("mode", "DCR") == "DCR":
        r = cx.reshape(cx.inp(0), (n, bs, bs, c // bs // bs, h, w))
        t = cx.transpose(r, (0, 3, 4, 1, 5, 2))
    else:  # CRD
        r = cx.reshape(cx.inp(0), (n, c // bs // bs, bs, bs, h, w))
        t = cx.transpose(r, (0, 1, 4, 2, 5, 3))
    cx.reshape(t, (n, c // bs // bs, h * bs, w * bs), out=cx.out())


def convert_space_to_depth(cx: NodeCtx):
    n, c, h, w = cx.shape(0)
    bs = int(cx.attr("blocksize"))
    if h % bs or w % bs:
        cx.fail(f"spatial size {(h, w)} is not a multiple of blocksize {bs}")
    r = cx.reshape(cx.inp(0), (n, c, h // bs, bs, w // bs, bs))
    # DCR (the only order before opset 28): blocks outside channels; CRD: channels outside
    perm = (0, 1, 3, 5, 2, 4) if cx.attr("mode", "DCR") == "CRD" else (0, 3, 5, 1, 2, 4)
    t = cx.transpose(r, perm)
    cx.reshape(t, (n, c * bs * bs, h // bs, w // bs), out=cx.out())


PAD_MODES = ("constant", "edge", "reflect")


def pad_unsupported(cx: NodeCtx) -> str | None:
    mode = cx.attr("mode", "constant")
    return None if mode in PAD_MODES else f"Pad mode '{mode}' is not supported (supported: {', '.join(PAD_MODES)})"


def convert_pad(cx: NodeCtx):
    shape = cx.shape(0)
    rank = len(shape)
    pads = cx.const_ints(1, "pads")
    value = 0.0
    if cx.has(2):
        v = cx.const(2)
        if v is None:
            cx.fail("the constant_value input must be a constant")
        value = float(np.asarray(v).reshape(-1)[0]) if np.asarray(v).size else 0.0
    axes = cx.const_ints(3, "axes") if cx.opset >= 18 else None
    axes = [cx.axis(a, rank) for a in axes] if axes else list(range(rank))
    if len(pads) != 2 * len(axes):
        cx.fail(f"pads {pads} must have 2 x {len(axes)} entries")
    begins, ends = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begins[a], ends[a] = pads[k], pads[k + len(axes)]
    oshape = [d + b + e for d, b, e in zip(shape, begins, ends)]
    if min(oshape, default=1) < 0:
        cx.fail(f"pads {pads} crop more than the input shape {shape}")
    mode = cx.attr("mode", "constant")
    cx.emit(Pad(tuple(begins), tuple(ends), mode, value), [cx.inp(0)], oshape, cx.dtype(0), out=cx.out())


def convert_dropout(cx: NodeCtx):
    # inference: Dropout is the identity; a requested mask is all true
    cx.alias(cx.inp(0), cx.out(0))
    if cx.out(1):
        cx.b.constant(np.ones(cx.shape(0), dtype=bool), name=cx.out(1))


def dropout_unsupported(cx: NodeCtx) -> str | None:
    if cx.has(2) and cx.const(2) is None:
        return "Dropout training_mode must be a constant"
    if cx.has(2) and bool(np.asarray(cx.const(2)).reshape(-1)[0]):
        return "Dropout in training mode (training_mode=True) is not supported"
    return None


# Shape/Constant/ConstantOfShape normally fold away before conversion; these cover a
# graph output that is itself a folded constant source.
def convert_constant(cx: NodeCtx):
    value = next(iter(cx.attrs.values()))
    value = numpy_helper.to_array(value) if hasattr(value, "dims") else np.asarray(value)
    cx.b.constant(value, name=cx.out())


def convert_shape(cx: NodeCtx):
    shape = cx.shape(0)
    cx.b.constant(np.array(shape[slice(cx.attr("start", 0), cx.attr("end", None))], dtype=np.int64), name=cx.out())


def convert_constant_of_shape(cx: NodeCtx):
    shape = cx.const_ints(0, "shape")
    value = cx.attrs.get("value")
    fill = numpy_helper.to_array(value).reshape(-1) if value is not None else np.zeros(1, np.float32)
    cx.b.constant(np.full(shape, fill[0], dtype=fill.dtype), name=cx.out())


CONVERTERS = {
    "Reshape": convert_reshape, "Flatten": convert_flatten, "Squeeze": convert_squeeze,
    "Unsqueeze": convert_unsqueeze, "Transpose": convert_transpose, "Concat": convert_concat,
    "Split": convert_split, "Slice": convert_slice, "Gather": convert_gather,
    "GatherElements": convert_gather_elements, "Expand": convert_expand, "Pad": convert_pad,
    "Dropout": convert_dropout, "Constant": convert_constant, "Shape": convert_shape,
    "ConstantOfShape": convert_constant_of_shape, "Tile": convert_tile, "DepthToSpace": convert_depth_to_space,
    "SpaceToDepth": convert_space_to_depth,
}
CHECKS = {"Pad": pad_unsupported, "Dropout": dropout_unsupported}
