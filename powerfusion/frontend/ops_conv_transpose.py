"""ConvTranspose as a Conv: the input is spread by the strides (zeros between elements,
by reshape + pad + reshape), padded by (k - 1) * dilation less the node's pads (negative
pads crop), and convolved at stride 1 with the weight's spatial axes flipped and its
in/out channels swapped within each group. The Conv is the library op it always was."""
from __future__ import annotations

from powerfusion.basic import Conv, Pad, Slice
from powerfusion.frontend.builder import NodeCtx


def _geometry(cx: NodeCtx, spatial, kernel, strides, dilations, out_pad):
    """(pad_begins, pad_ends) of the transposed conv as ONNX defines them."""
    nsp = len(spatial)
    auto = cx.attr("auto_pad", "NOTSET")
    output_shape = cx.attr("output_shape", None)
    if output_shape is None and auto in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [s * st for s, st in zip(spatial, strides)]
    if output_shape is None:
        pads = cx.attr("pads", None) or [0] * (2 * nsp)
        return list(pads[:nsp]), list(pads[nsp:])
    output_shape = list(output_shape)[-nsp:]
    begins, ends = [], []
    for i in range(nsp):
        total = strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 - output_shape[i]
        if auto == "SAME_UPPER":
            begins.append(total // 2), ends.append(total - total // 2)
        else:
            begins.append(total - total // 2), ends.append(total // 2)
    return begins, ends


def _spread(cx: NodeCtx, x: str, axis: int, stride: int) -> str:
    """Zeros between the elements of `axis`: [.., S, ..] -> [.., (S - 1) * stride + 1, ..]."""
    if stride == 1:
        return x
    shape = cx.info(x).shape
    s = shape[axis]
    wide = cx.reshape(x, shape[:axis + 1] + (1,) + shape[axis + 1:])
    begins = [0] * (len(shape) + 1)
    ends = [0] * (len(shape) + 1)
    ends[axis + 1] = stride - 1
    padded_shape = shape[:axis + 1] + (stride,) + shape[axis + 1:]
    p = cx.emit(Pad(tuple(begins), tuple(ends)), [wide], padded_shape, cx.info(x).dtype)
    flat = cx.reshape(p, shape[:axis] + (s * stride,) + shape[axis + 1:])
    keep = (s - 1) * stride + 1
    stops = list(shape[:axis]) + [keep] + list(shape[axis + 1:])
    return cx.emit(Slice((0,) * len(shape), tuple(stops), (1,) * len(shape)), [flat], tuple(stops), cx.info(x).dtype)


def _conv_weight(cx: NodeCtx, w: str, group: int) -> str:
    """[C, M/g, *K] -> [M, C/g, *K] with every spatial axis reversed."""
    shape = cx.info(w).shape
    c, mg, kernel = shape[0], shape[1], shape[2:]
    nsp = len(kernel)
    r = cx.reshape(w, (group, c // group, mg) + kernel)
    t = cx.transpose(r, (0, 2, 1) + tuple(range(3, 3 + nsp)))
    t = cx.reshape(t, (group * mg, c // group) + kernel)
    starts = (0, 0) + tuple(k - 1 for k in kernel)
    stops = (group * mg, c // group) + (None,) * nsp
    steps = (1, 1) + (-1,) * nsp
    return cx.emit(Slice(starts, stops, steps), [t], cx.info(t).shape, cx.info(t).dtype)


def convert_conv_transpose(cx: NodeCtx):
    xs, ws = cx.shape(0), cx.shape(1)
    nsp = len(xs) - 2
    group = int(cx.attr("group", 1))
    kernel = tuple(cx.attr("kernel_shape", None) or ws[2:])
    strides = tuple(cx.attr("strides", None) or [1] * nsp)
    dil = tuple(cx.attr("dilations", None) or [1] * nsp)
    out_pad = tuple(cx.attr("output_padding", None) or [0] * nsp)
    if xs[1] != ws[0] or ws[0] % group:
        cx.fail(f"input channels {xs[1]} / weight {ws} do not match group={group}")
    begins, ends = _geometry(cx, xs[2:], kernel, strides, dil, out_pad)
    x = cx.inp(0)
    for i in range(nsp):
        x = _spread(cx, x, 2 + i, strides[i])
    grow_b = [(k - 1) * d - b for k, d, b in zip(kernel, dil, begins)]
    grow_e = [(k - 1) * d - e + op for k, d, e, op in zip(kernel, dil, ends, out_pad)]
    if any(grow_b) or any(grow_e):
        shape = cx.info(x).shape
        oshape = shape[:2] + tuple(s + b + e for s, b, e in zip(shape[2:], grow_b, grow_e))
        x = cx.emit(Pad((0, 0) + tuple(grow_b), (0, 0) + tuple(grow_e)), [x], oshape, cx.dtype(0))
    w = _conv_weight(cx, cx.inp(1), group)
    m = cx.info(w).shape[0]
    outs = tuple(s - (k - 1) * d for s, k, d in zip(cx.info(x).shape[2:], kernel, dil))
    if min(outs, default=1) <= 0:
        cx.fail(f"output size {outs} is not positive")
    inputs = [x, w] + ([cx.inp(2)] if cx.has(2) else [])
    cx.emit(Conv((1,) * nsp, (0,) * nsp, (0,) * nsp, dil, group), inputs, (xs[0], m) + outs, cx.dtype(0),
            out=cx.out())


CONVERTERS = {"ConvTranspose": convert_conv_transpose}
