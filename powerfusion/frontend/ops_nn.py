"""Converters for reductions and the composite neural-network ops (softmax, normalisations,
matmul/gemm, conv, pooling, LRN).

fp16/bf16 Softmax, LogSoftmax, LayerNormalization and InstanceNormalization are
computed in float32 between two casts: their reductions lose too much otherwise.
Conv is always emitted as a Conv basic op, depthwise included; the partition's cost
test then puts a depthwise conv (low intensity) in a memory-bound subgraph.
"""
from __future__ import annotations

import math

import numpy as np

from powerfusion.basic import Broadcast, Conv, Elementwise, MatMul, Reshape, Transpose, Window
from powerfusion.frontend.builder import NodeCtx
from powerfusion.frontend.numpy_exec import window_view

REDUCE = {"ReduceSum": "sum", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod", "ReduceMean": "mean",
          "ReduceSumSquare": "sumsquare", "ReduceL1": "l1", "ReduceL2": "l2", "ReduceLogSumExp": "logsumexp"}
LOW_PRECISION = ("float16", "bfloat16")


def _upcast(cx: NodeCtx, name: str) -> str:
    return cx.cast(name, np.float32) if cx.info(name).dtype.name in LOW_PRECISION else name


def _finish(cx: NodeCtx, name: str, dtype, out: str):
    """Cast back to the node's dtype (if computed in fp32) under the ONNX output name."""
    if cx.info(name).dtype != np.dtype(dtype):
        cx.cast(name, dtype, out=out)
    else:
        cx.alias(name, out)


def _div_by(cx: NodeCtx, name: str, n: int, out=None) -> str:
    dt = cx.info(name).dtype
    if dt.kind == "f" or dt.name == "bfloat16":   # the mean of nothing is 0, as onnxruntime gives it
        return cx.ew("mul", name, cx.scalar(1.0 / n if n else 0.0, dt), out=out)
    return cx.ew("div", name, cx.scalar(n, dt), out=out)


# ---- reductions ---------------------------------------------------------------------

def convert_reduce(cx: NodeCtx):
    kind = REDUCE[cx.op_type]
    rank = len(cx.shape(0))
    since = 13 if cx.op_type == "ReduceSum" else 18
    axes = cx.const_ints(1, "axes") if cx.opset >= since else cx.attr("axes", None)
    keep = bool(cx.attr("keepdims", 1))
    x = cx.inp(0)
    if not axes:
        if cx.attr("noop_with_empty_axes", 0):
            cx.alias(x, cx.out())
            return
        axes = list(range(rank))
    axes = [cx.axis(a, rank) for a in axes]
    out = cx.out()
    if kind in ("sum", "max", "min", "prod"):
        cx.reduce(kind, x, axes, keep, out=out)
    elif kind == "mean":
        n = int(np.prod([cx.shape(0)[a] for a in set(axes)], dtype=np.int64))
        _div_by(cx, cx.reduce("sum", x, axes, keep), n, out=out)
    elif kind == "sumsquare":
        cx.reduce("sum", cx.ew("mul", x, x), axes, keep, out=out)
    elif kind == "l1":
        cx.reduce("sum", cx.ew("abs", x), axes, keep, out=out)
    elif kind == "l2":
        cx.ew("sqrt", cx.reduce("sum", cx.ew("mul", x, x), axes, keep), out=out)
    else:  # logsumexp, stabilised by the max where it is finite (a +inf or all -inf row gives +-inf, not NaN)
        top = cx.reduce("max", x, axes, True)
        dt = cx.info(top).dtype
        finite = cx.ew("less", cx.ew("abs", top), cx.scalar(np.inf, dt))
        m = cx.ew("where", finite, top, cx.scalar(0, dt))
        s = cx.reduce("sum", cx.ew("exp", cx.ew("sub", x, m)), axes, keep)
        m_out = m if keep else cx.reshape(m, cx.info(s).shape)
        cx.ew("add", cx.ew("log", s), m_out, out=out)


def convert_softmax(cx: NodeCtx, log: bool = False):
    shape, dt = cx.shape(0), cx.dtype(0)
    axis = cx.axis(cx.attr("axis", -1 if cx.opset >= 13 else 1), len(shape))
    # before opset 13 the input is coerced to 2-D at `axis`: the same as reducing all trailing axes
    axes = [axis] if cx.opset >= 13 else list(range(axis, len(shape)))
    x = _upcast(cx, cx.inp(0))
    d = cx.ew("sub", x, cx.reduce("max", x, axes, True))
    e = cx.ew("exp", d)
    s = cx.reduce("sum", e, axes, True)
    # one reciprocal per row and a multiply per element (see ops_elementwise.convert_div)
    y = cx.ew("sub", d, cx.ew("log", s)) if log else cx.ew("mul", e, cx.ew("reciprocal", s))
    _finish(cx, y, dt, cx.out())


def convert_log_softmax(cx: NodeCtx):
    convert_softmax(cx, log=True)


# ---- normalisations -------------------------------------------------------------------

def _normalize(cx: NodeCtx, x: str, axes, eps: float):
    """(x - mean) * rsqrt(var + eps), plus mean and the inverse std (keepdims).

    Two passes (mean, then the mean of squared deviations). A one-pass form shifted by the
    slice's first element was tried for slices of 32768+ elements (LayerNorm 32768x65536 on
    H200: 0.43 -> 0.53 of copy bandwidth, x read twice instead of three times) and taken
    out: where x is computed inside the subgraph (a Cast before the LayerNorm), slicing it
    broke the fusion and the search's best plan was 16-28 kernels, predicted 5-7x slower.
    Recorded in benchmarks/results/gir-2026-11-22-session5.md."""
    n = int(np.prod([cx.info(x).shape[a] for a in axes], dtype=np.int64))
    mean = _div_by(cx, cx.reduce("sum", x, axes, True), n)
    d = cx.ew("sub", x, mean)
    var = _div_by(cx, cx.reduce("sum", cx.ew("mul", d, d), axes, True), n)
    inv = cx.ew("rsqrt", cx.ew("add", var, cx.scalar(eps, cx.info(x).dtype)))
    return cx.ew("mul", d, inv), mean, inv


def convert_layer_norm(cx: NodeCtx):
    shape, dt = cx.shape(0), cx.dtype(0)
    axis = cx.axis(cx.attr("axis", -1), len(shape))
    axes = list(range(axis, len(shape)))
    x = _upcast(cx, cx.inp(0))
    y, mean, inv = _normalize(cx, x, axes, float(cx.attr("epsilon", 1e-5)))
    y = cx.ew("mul", y, _upcast(cx, cx.inp(1)))
    if cx.has(2):
        y = cx.ew("add", y, _upcast(cx, cx.inp(2)))
    _finish(cx, y, dt, cx.out(0))
    for i, t in ((1, mean), (2, inv)):
        if cx.out(i):
            want = cx.out_info(i).dtype if cx.out_info(i) else np.float32
            _finish(cx, t, want, cx.out(i))


def _per_channel(cx: NodeCtx, name: str, rank: int) -> str:
    """[C] -> [C, 1, ..., 1] so that it broadcasts against [N, C, *S]."""
    return cx.reshape(name, (cx.info(name).size,) + (1,) * (rank - 2))


def convert_instance_norm(cx: NodeCtx):
    shape, dt = cx.shape(0), cx.dtype(0)
    x = _upcast(cx, cx.inp(0))
    y, _, _ = _normalize(cx, x, list(range(2, len(shape))), float(cx.attr("epsilon", 1e-5)))
    y = cx.ew("mul", y, _per_channel(cx, _upcast(cx, cx.inp(1)), len(shape)))
    y = cx.ew("add", y, _per_channel(cx, _upcast(cx, cx.inp(2)), len(shape)))
    _finish(cx, y, dt, cx.out())


def batch_norm_unsupported(cx: NodeCtx) -> str | None:
    if cx.attr("training_mode", 0) or any(cx.out(i) for i in range(1, len(cx.node.output))):
        return "BatchNormalization in training mode (or with running-statistics outputs) is not supported"
    return None


def convert_batch_norm(cx: NodeCtx):
    shape, dt = cx.shape(0), cx.dtype(0)
    eps = float(cx.attr("epsilon", 1e-5))
    params = [cx.const(i) for i in range(1, 5)]
    if all(p is not None for p in params):
        # inference: fold into one scale and one shift per channel
        gamma, beta, mean, var = (np.asarray(p, dtype=np.float64) for p in params)
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        s = _per_channel(cx, cx.b.constant(scale.astype(dt), hint="bn_scale"), len(shape))
        t = _per_channel(cx, cx.b.constant(shift.astype(dt), hint="bn_shift"), len(shape))
    else:
        gamma, beta, mean, var = (_per_channel(cx, cx.inp(i), len(shape)) for i in range(1, 5))
        s = cx.ew("mul", gamma, cx.ew("rsqrt", cx.ew("add", var, cx.scalar(eps, cx.info(var).dtype))))
        t = cx.ew("sub", beta, cx.ew("mul", mean, s))
        s, t = cx.cast(s, dt), cx.cast(t, dt)
    cx.ew("add", cx.ew("mul", cx.inp(0), s), t, out=cx.out())


def convert_lrn(cx: NodeCtx):
    shape, dt = cx.shape(0), cx.dtype(0)
    size = int(cx.attr("size"))
    alpha, beta, bias = float(cx.attr("alpha", 1e-4)), float(cx.attr("beta", 0.75)), float(cx.attr("bias", 1.0))
    x = cx.inp(0)
    n, c = shape[0], shape[1]
    rest = int(np.prod(shape[2:], dtype=np.int64))
    # a window of `size` channels: view [N, C, S] as [N, 1, C, S] and slide along C
    sq = cx.reshape(cx.ew("mul", x, x), (n, 1, c, rest))
    win = Window((size, 1), (1, 1), (1, 1), ((size - 1) // 2, 0), (size - 1 - (size - 1) // 2, 0))
    w = cx.emit(win, [sq], (n, 1, c, rest, size, 1), dt)
    s = cx.reshape(cx.reduce("sum", w, (4, 5), False), shape)
    denom = cx.ew("add", cx.ew("mul", s, cx.scalar(alpha / size, dt)), cx.scalar(bias, dt))
    cx.ew("div", x, cx.ew("pow", denom, cx.scalar(beta, dt)), out=cx.out())


# ---- matmul, gemm, conv ---------------------------------------------------------------

def matmul(cx: NodeCtx, a: str, b: str, trans_a=False, trans_b=False, out=None, dtype=None) -> str:
    """MatMul of a and b; its result is of a's dtype unless `dtype` says otherwise (int8 x int8
    accumulates into int32)."""
    sa, sb = list(cx.info(a).shape), list(cx.info(b).shape)
    if len(sa) == 1 or len(sb) == 1:
        # numpy's 1-D promotion, made explicit so the library op always sees matrices
        a2 = cx.reshape(a, [1] + sa) if len(sa) == 1 else a
        b2 = cx.reshape(b, sb + [1]) if len(sb) == 1 else b
        r = matmul(cx, a2, b2, trans_a, trans_b, dtype=dtype)
        shape = list(cx.info(r).shape)
        if len(sa) == 1:
            del shape[-2]
        if len(sb) == 1:
            del shape[-1]
        return cx.reshape(r, shape, out=out)
    a, trans_a = _swapped_source(cx, a, trans_a)
    b, trans_b = _swapped_source(cx, b, trans_b)
    sa, sb = list(cx.info(a).shape), list(cx.info(b).shape)
    m, k = (sa[-1], sa[-2]) if trans_a else (sa[-2], sa[-1])
    k2, n = (sb[-1], sb[-2]) if trans_b else (sb[-2], sb[-1])
    if k != k2:
        cx.fail(f"inner dimensions differ: {tuple(sa)} x {tuple(sb)}")
    try:
        batch = np.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2]))
    except ValueError:
        cx.fail(f"batch dimensions of {tuple(sa)} and {tuple(sb)} do not broadcast")
    return cx.emit(MatMul(trans_a, trans_b), [a, b], tuple(batch) + (m, n), dtype or cx.info(a).dtype, out)


def _swapped_source(cx: NodeCtx, name: str, trans: bool) -> tuple[str, bool]:
    """An operand made by a Transpose that swaps only the last two axes is read through the
    MatMul's trans flag instead (k^T of attention): the GEMV templates then see K's own
    layout, and the library call a transposed operand. The Transpose, left without
    consumers, is dropped with the other dead nodes after conversion.

    Between the Transpose and the MatMul there may be Reshapes of the batch axes only and
    elementwise ops whose other operands are broadcast scalars (the exporters' split of the
    attention scale, q * s^0.5 and k^T * s^0.5): they commute with the swap, so they are
    re-emitted on the untransposed tensor. Without this the swap stays a memory-bound
    transpose whose writes cross units, which splits the attention's QKV kernel in two
    (measured on the H200, ViT-B/16 fp16: 10.6 us a layer)."""
    chain, cur = [], name
    while True:
        node = next((n for n in reversed(cx.b.nodes) if cur in n.outputs), None)
        if node is None:
            return name, trans
        if isinstance(node.op, Transpose):
            break
        if not _commutes_with_swap(cx, node, cur):
            return name, trans
        chain.append(node)
        cur = _chained_input(cx, node)
    perm, r = node.op.perm, len(node.op.perm)
    if r < 2:
        return name, trans
    src = node.inputs[0]
    if perm != tuple(range(r - 2)) + (r - 1, r - 2):
        # Transpose(x, p) is the last-two swap of Transpose(x, p'), p' = p with its last two
        # entries swapped: where p' keeps x's innermost axis innermost (a permutation of rows,
        # e.g. BERT's folded k.permute(0, 2, 3, 1) = (0, 2, 1, 3) then the swap), the operand
        # becomes that row transpose, read through the trans flag
        inner = perm[:-2] + (perm[-1], perm[-2])
        if inner[-1] != r - 1:
            return name, trans
        src = cx.transpose(src, inner)
    for link in reversed(chain):
        src = _reemit_swapped(cx, link, src)
    return src, not trans


def _chained_input(cx: NodeCtx, node) -> str:
    """The one input of a chain link that is not a broadcast scalar."""
    if isinstance(node.op, Reshape):
        return node.inputs[0]
    return next(i for i in node.inputs if not _broadcast_scalar(cx, i))


def _broadcast_scalar(cx: NodeCtx, t: str) -> str | None:
    """The size-1 tensor `t` broadcasts (t itself when it has one element), else None."""
    if cx.info(t).size == 1:
        return t
    node = next((n for n in reversed(cx.b.nodes) if t in n.outputs), None)
    if node is not None and isinstance(node.op, Broadcast) and cx.info(node.inputs[0]).size == 1:
        return node.inputs[0]
    return None


def _commutes_with_swap(cx: NodeCtx, node, out: str) -> bool:
    shape = cx.info(out).shape
    if isinstance(node.op, Reshape):
        src = cx.info(node.inputs[0]).shape
        return len(src) >= 2 and len(shape) >= 2 and tuple(src[-2:]) == tuple(shape[-2:])
    if not isinstance(node.op, Elementwise) or len(node.outputs) != 1:
        return False
    rest = [i for i in node.inputs if not _broadcast_scalar(cx, i)]
    return len(rest) == 1 and cx.info(rest[0]).shape == shape


def _reemit_swapped(cx: NodeCtx, link, src: str) -> str:
    """`link` (a batch Reshape or a scalar elementwise op) applied to `src`, which is its
    input with the last two axes swapped."""
    if isinstance(link.op, Reshape):
        shape = tuple(link.op.shape)
        return cx.reshape(src, shape[:-2] + (shape[-1], shape[-2]))
    shape = cx.info(src).shape
    ins = [src if not _broadcast_scalar(cx, i) else cx.bcast(_broadcast_scalar(cx, i), shape) for i in link.inputs]
    return cx.emit(link.op, ins, shape, cx.info(link.outputs[0]).dtype)


def convert_matmul(cx: NodeCtx):
    matmul(cx, cx.inp(0), cx.inp(1), out=cx.out())


def convert_matmul_integer(cx: NodeCtx):
    """MatMulInteger of two int8 operands without zero points (the form precision/qdq.py leaves
    for integer GEMMs; it folds zero points into memory-bound terms): a MatMul with an int32
    result. Other forms are lowered to float ops before conversion."""
    if any(cx.has(i) for i in (2, 3)) or cx.dtype(0) != np.int8 or cx.dtype(1) != np.int8:
        cx.fail("only int8 x int8 without zero points is converted directly "
                f"(got {cx.dtype(0)} x {cx.dtype(1)}{' with zero points' if cx.has(2) or cx.has(3) else ''})")
    matmul(cx, cx.inp(0), cx.inp(1), out=cx.out(), dtype=np.int32)


def convert_gemm(cx: NodeCtx):
    alpha, beta = float(cx.attr("alpha", 1.0)), float(cx.attr("beta", 1.0))
    dt = cx.dtype(0)
    has_c = cx.has(2) and beta != 0.0
    y = matmul(cx, cx.inp(0), cx.inp(1), bool(cx.attr("transA", 0)), bool(cx.attr("transB", 0)),
               out=None if (alpha != 1.0 or has_c) else cx.out())
    if alpha != 1.0:
        y = cx.ew("mul", y, cx.scalar(alpha, dt), out=None if has_c else cx.out())
    if has_c:
        c = cx.const(2)
        if c is not None and beta != 1.0:
            c_name = cx.b.constant((np.asarray(c, dtype=np.float64) * beta).astype(dt), hint="gemm_c")
        elif beta != 1.0:
            c_name = cx.ew("mul", cx.inp(2), cx.scalar(beta, dt))
        else:
            c_name = cx.inp(2)
        cx.ew("add", y, c_name, out=cx.out())


def window_geometry(cx: NodeCtx, spatial, kernel, strides, dilations, ceil_mode=False):
    """Explicit (pad_begins, pad_ends, output sizes) for Conv and pooling, auto_pad included.
    With ceil_mode the last window may run past the end padding; pad_ends grows to cover it."""
    auto = cx.attr("auto_pad", "NOTSET")
    pads = cx.attr("pads", None) or [0] * (2 * len(spatial))
    begins, ends, outs = [], [], []
    for i, (s, k, st, d) in enumerate(zip(spatial, kernel, strides, dilations)):
        ek = (k - 1) * d + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-s // st)
            total = max((o - 1) * st + ek - s, 0)
            b = total // 2 if auto == "SAME_UPPER" else total - total // 2
            e = total - b
        elif auto == "VALID":
            b, e, o = 0, 0, (s - ek) // st + 1
        elif auto == "NOTSET":
            b, e = pads[i], pads[i + len(spatial)]
            span = s + b + e - ek
            o = (-(-span // st) if ceil_mode else span // st) + 1
            if ceil_mode and (o - 1) * st >= s + b:
                o -= 1  # a window may not start inside the end padding
            e += max((o - 1) * st + ek - (s + b + e), 0)
        else:
            cx.fail(f"unknown auto_pad '{auto}'")
        if o <= 0:
            cx.fail(f"spatial size {s} is too small for kernel {k} (dilation {d}, padding {b}+{e})")
        begins.append(b), ends.append(e), outs.append(o)
    return tuple(begins), tuple(ends), tuple(outs)


def convert_conv_integer(cx: NodeCtx):
    """ConvInteger of two int8 operands without zero points (as convert_matmul_integer): a Conv
    with an int32 result; padding is with zeros."""
    if any(cx.has(i) for i in (2, 3)) or cx.dtype(0) != np.int8 or cx.dtype(1) != np.int8:
        cx.fail("only int8 x int8 without zero points is converted directly "
                f"(got {cx.dtype(0)} x {cx.dtype(1)}{' with zero points' if cx.has(2) or cx.has(3) else ''})")
    convert_conv(cx, np.int32)


def convert_conv(cx: NodeCtx, dtype=None):
    xs, ws = cx.shape(0), cx.shape(1)
    nsp = len(xs) - 2
    group = int(cx.attr("group", 1))
    kernel = tuple(cx.attr("kernel_shape", None) or ws[2:])
    strides = tuple(cx.attr("strides", None) or [1] * nsp)
    dil = tuple(cx.attr("dilations", None) or [1] * nsp)
    if xs[1] != ws[1] * group or ws[0] % group:
        cx.fail(f"input channels {xs[1]} / weight {ws} do not match group={group}")
    begins, ends, outs = window_geometry(cx, xs[2:], kernel, strides, dil)
    inputs = [cx.inp(0), cx.inp(1)] + ([cx.inp(2)] if cx.has(2) else [])
    cx.emit(Conv(strides, begins, ends, dil, group), inputs, (xs[0], ws[0]) + outs, dtype or cx.dtype(0), out=cx.out())


# ---- pooling ----------------------------------------------------------------------------

def _pool_window(cx: NodeCtx, pad_value: float):
    # with ceil_mode, onnx shape inference keeps a last window that starts in the end padding;
    # onnxruntime and the onnx reference drop it, and so do we
    cx.check_shapes = not cx.attr("ceil_mode", 0)
    xs = cx.shape(0)
    nsp = len(xs) - 2
    kernel = tuple(cx.attr("kernel_shape"))
    strides = tuple(cx.attr("strides", None) or [1] * nsp)
    dil = tuple(cx.attr("dilations", None) or [1] * nsp)
    begins, ends, outs = window_geometry(cx, xs[2:], kernel, strides, dil, bool(cx.attr("ceil_mode", 0)))
    win = Window(kernel, strides, dil, begins, ends, pad_value)
    w = cx.emit(win, [cx.inp(0)], xs[:2] + outs + kernel, cx.dtype(0))
    return w, win, outs


def maxpool_unsupported(cx: NodeCtx) -> str | None:
    return "MaxPool's Indices output is not supported" if cx.out(1) else None


def convert_maxpool(cx: NodeCtx):
    dt = cx.dtype(0)
    low = float(np.iinfo(dt).min) if dt.kind in "iu" else -math.inf
    w, _, outs = _pool_window(cx, low)
    nsp = len(outs)
    cx.reduce("max", w, range(2 + nsp, 2 + 2 * nsp), False, out=cx.out())


def convert_avgpool(cx: NodeCtx):
    xs, dt = cx.shape(0), cx.dtype(0)
    w, win, outs = _pool_window(cx, 0.0)
    nsp = len(outs)
    s = cx.reduce("sum", w, range(2 + nsp, 2 + 2 * nsp), False)
    count = _pool_counts(xs[2:], win, cx.attr("pads", None), bool(cx.attr("count_include_pad", 0)))
    if np.all(count == count.reshape(-1)[0]):
        cx.ew("mul", s, cx.scalar(1.0 / count.reshape(-1)[0], dt), out=cx.out())
    else:
        cx.ew("mul", s, cx.b.constant((1.0 / count).astype(dt), hint="pool_inv_count"), out=cx.out())


def _pool_counts(spatial, win: Window, pads, include_pad: bool) -> np.ndarray:
    """How many positions each output window averages: real inputs, plus the explicit
    `pads` when count_include_pad (never the extra end padding added for ceil_mode or auto_pad)."""
    mask = np.ones(spatial, dtype=np.float64)
    begins, ends = win.pad_begins, win.pad_ends
    if include_pad and pads:
        explicit = [(pads[i], pads[i + len(spatial)]) for i in range(len(spatial))]
        mask = np.pad(mask, explicit, constant_values=1.0)
        begins = tuple(b - e[0] for b, e in zip(begins, explicit))
        ends = tuple(b - e[1] for b, e in zip(ends, explicit))
    inner = Window(win.kernel, win.strides, win.dilations, begins, ends, 0.0)
    view = window_view(mask[None, None], inner)[0, 0]
    return view.reshape(view.shape[:len(spatial)] + (-1,)).sum(axis=-1)


def _abs_pow(cx: NodeCtx, x: str, p: int) -> str:
    """|x|^p, with the common p as multiplies."""
    if p == 1:
        return cx.ew("abs", x)
    if p == 2:
        return cx.ew("mul", x, x)
    return cx.ew("pow", cx.ew("abs", x), cx.scalar(float(p), cx.info(x).dtype))


def _root(cx: NodeCtx, x: str, p: int, out=None) -> str:
    if p == 1:
        return cx.alias(x, out) if out else x
    if p == 2:
        return cx.ew("sqrt", x, out=out)
    return cx.ew("pow", x, cx.scalar(1.0 / p, cx.info(x).dtype), out=out)


def convert_lp_pool(cx: NodeCtx):
    p = int(cx.attr("p", 2))
    w, _, outs = _pool_window(cx, 0.0)
    nsp = len(outs)
    s = cx.reduce("sum", _abs_pow(cx, w, p), range(2 + nsp, 2 + 2 * nsp), False)
    _root(cx, s, p, out=cx.out())


def convert_lp_normalization(cx: NodeCtx):
    shape = cx.shape(0)
    p = int(cx.attr("p", 2))
    if p not in (1, 2):
        cx.fail(f"LpNormalization p={p}: ONNX defines p = 1 or 2")
    axis = cx.axis(cx.attr("axis", -1), len(shape))
    x = cx.inp(0)
    norm = _root(cx, cx.reduce("sum", _abs_pow(cx, x, p), [axis], True), p)
    dt = cx.dtype(0)
    zero = cx.ew("equal", norm, cx.scalar(0, dt))
    norm = cx.ew("where", zero, cx.scalar(1, dt), norm)   # an all-zero slice stays zero, as the reference has it
    cx.ew("div", x, norm, out=cx.out())


def convert_global_pool(cx: NodeCtx):
    xs = cx.shape(0)
    axes = list(range(2, len(xs)))
    if cx.op_type == "GlobalMaxPool":
        cx.reduce("max", cx.inp(0), axes, True, out=cx.out())
        return
    n = int(np.prod(xs[2:], dtype=np.int64))
    _div_by(cx, cx.reduce("sum", cx.inp(0), axes, True), n, out=cx.out())


CONVERTERS = {op: convert_reduce for op in REDUCE}
CONVERTERS.update({
    "Softmax": convert_softmax, "LogSoftmax": convert_log_softmax, "LayerNormalization": convert_layer_norm,
    "InstanceNormalization": convert_instance_norm, "BatchNormalization": convert_batch_norm, "LRN": convert_lrn,
    "MatMul": convert_matmul, "Gemm": convert_gemm, "Conv": convert_conv, "MaxPool": convert_maxpool,
    "AveragePool": convert_avgpool, "LpPool": convert_lp_pool, "LpNormalization": convert_lp_normalization, "GlobalAveragePool": convert_global_pool, "GlobalMaxPool": convert_global_pool,
})
CONVERTERS.update({"MatMulInteger": convert_matmul_integer, "ConvInteger": convert_conv_integer})
CHECKS = {"BatchNormalization": batch_norm_unsupported, "MaxPool": maxpool_unsupported}
