"""A reference executor of basic graphs in numpy: one function per basic op kind.

Elementwise ops on fp16/bf16 compute in fp32 and round back (as every backend does);
reductions on them accumulate in fp32. MatMul/Conv on fp16/bf16 also accumulate in fp32.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from powerfusion.errors import DataError, FeedError
from powerfusion import basic as B
from powerfusion.frontend.fallback import run_fallback
from powerfusion.frontend.quantized import run_typed_matmul as run_quantized_matmul
from powerfusion.scalar import scalar_fn

LOW_PRECISION = ("float16", "bfloat16")


def _wide(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype.name in LOW_PRECISION else x


def run_basic_graph(graph: B.BasicGraph, feeds: dict) -> dict[str, np.ndarray]:
    env: dict[str, np.ndarray] = dict(graph.constants)
    unknown = sorted(set(feeds) - {t.name for t in graph.inputs})
    if unknown:
        raise FeedError(f"feeds {unknown} are not inputs of '{graph.name}' (inputs: {[t.name for t in graph.inputs]})")
    for t in graph.inputs:
        if t.name not in feeds:
            raise FeedError(f"missing feed for input '{t.name}' (shape {t.shape}, {np.dtype(t.dtype).name})")
        x = np.asarray(feeds[t.name])
        if tuple(x.shape) != tuple(t.shape) or x.dtype != np.dtype(t.dtype):
            raise FeedError(f"input '{t.name}' expects shape {t.shape} and dtype {np.dtype(t.dtype).name}, "
                            f"got {tuple(x.shape)} {x.dtype.name}")
        env[t.name] = x
    for node in graph.nodes:
        args = [env[i] for i in node.inputs]
        out = graph.tensors[node.outputs[0]]
        y = EXECUTORS[type(node.op)](node.op, args, np.dtype(out.dtype))
        env[node.outputs[0]] = np.asarray(y).astype(out.dtype, copy=False).reshape(out.shape)
    return {t.name: env[t.name] for t in graph.outputs}


def run_elementwise(op: B.Elementwise, args, dtype):
    fn = scalar_fn(op.fn)
    with np.errstate(all="ignore"):
        return fn.numpy(*(_wide(a) for a in args), **dict(op.params)).astype(dtype)


def run_reduce(op: B.Reduce, args, dtype):
    x = _wide(args[0])
    f = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op.fn]
    # identities make empty reductions well defined (ONNX: max of nothing is the lowest value)
    initial = {"max": _lowest(x.dtype), "min": _highest(x.dtype)}.get(op.fn, np._NoValue)
    return f(x, axis=op.axes, keepdims=op.keepdims, initial=initial).astype(dtype)


def _lowest(dt):
    return False if dt == bool else (np.iinfo(dt).min if dt.kind in "iu" else -np.inf)


def _highest(dt):
    return True if dt == bool else (np.iinfo(dt).max if dt.kind in "iu" else np.inf)


def run_slice(op: B.Slice, args, dtype):
    return args[0][tuple(slice(b, e, s) for b, e, s in zip(op.starts, op.stops, op.steps))]


def run_pad(op: B.Pad, args, dtype):
    x = args[0]
    # negative pads crop first, then numpy pads the rest
    crop = tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0)) for i, (b, e) in enumerate(zip(op.begins, op.ends)))
    x = x[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(op.begins, op.ends)]
    if op.mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=np.asarray(op.value).astype(x.dtype))
    return np.pad(x, widths, mode=op.mode)


def window_view(x: np.ndarray, op: B.Window) -> np.ndarray:
    """[N, C, *S] -> [N, C, *O, *K] (a copy); channels-last [N, *S, C] -> [N, *O, *K, C]."""
    if op.channels_last:
        plain = dataclasses.replace(op, channels_last=False)
        return np.asarray(np.moveaxis(window_view(np.moveaxis(x, -1, 1), plain), 1, -1), order="C")
    nsp = len(op.kernel)
    widths = [(0, 0), (0, 0)] + list(zip(op.pad_begins, op.pad_ends))
    if x.dtype.kind in "iu" and not np.isfinite(op.pad_value):  # -inf into integers: the lowest value
        fill = np.iinfo(x.dtype).min
    else:
        fill = np.asarray(op.pad_value).astype(x.dtype)
    xp = np.pad(x, widths, mode="constant", constant_values=fill)
    ek = [(k - 1) * d + 1 for k, d in zip(op.kernel, op.dilations)]
    outs = [(xp.shape[2 + i] - ek[i]) // op.strides[i] + 1 for i in range(nsp)]
    full = np.lib.stride_tricks.sliding_window_view(xp, ek, axis=tuple(range(2, 2 + nsp)))
    index = [slice(None), slice(None)]
    index += [slice(0, (o - 1) * s + 1, s) for o, s in zip(outs, op.strides)]
    index += [slice(None, None, d) for d in op.dilations]
    return np.asarray(full[tuple(index)], order="C")


def run_matmul(op: B.MatMul, args, dtype):
    a, b = (_wide(x) for x in args[:2])
    if np.dtype(dtype).kind in "iu":   # integer GEMMs (int8 x int8 -> int32) accumulate exactly
        a, b = a.astype(np.int64), b.astype(np.int64)
    if op.trans_a:
        a = np.swapaxes(a, -1, -2)
    if op.trans_b:
        b = np.swapaxes(b, -1, -2)
    y = np.matmul(a, b)
    if op.bias:   # the epilogue: added before the one rounding
        y = y + _wide(args[2])
    return y.astype(dtype)


def run_conv(op: B.Conv, args, dtype):
    if op.channels_last:   # the same convolution on NCHW views, the output back to NHWC
        plain = dataclasses.replace(op, channels_last=False)
        y = run_conv(plain, [np.moveaxis(args[0], -1, 1), np.moveaxis(args[1], -1, 1), *args[2:]], dtype)
        return np.asarray(np.moveaxis(y, 1, -1), order="C")
    x, w = _wide(args[0]), _wide(args[1])
    if np.dtype(dtype).kind in "iu":   # integer convolutions (int8 x int8 -> int32) accumulate exactly
        x, w = x.astype(np.int64), w.astype(np.int64)
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    g = op.group
    win = B.Window(tuple(w.shape[2:]), op.strides, op.dilations, op.pad_begins, op.pad_ends, 0.0)
    cols = window_view(x, win)  # [N, C, *O, *K]
    nsp = len(op.strides)
    outs = cols.shape[2:2 + nsp]
    cols = cols.reshape(n, g, cg, -1, int(np.prod(w.shape[2:])))        # [N, G, C/G, O, K]
    wg = w.reshape(g, m // g, cg, -1)                                     # [G, M/G, C/G, K]
    y = np.einsum("ngcok,gmck->ngmo", cols, wg, optimize=True).reshape((n, m) + tuple(outs))
    if len(args) > 2:
        y = y + _wide(args[2]).reshape((1, m) + (1,) * nsp)
    return y.astype(dtype)


def run_involution(op: B.Involution, args, dtype):
    """float32 (float64 for float64 data) products summed over each window (B.Involution)."""
    x, w = _wide(args[0]), _wide(args[1])
    n, c = x.shape[:2]
    g = w.shape[1]
    win = B.Window(op.kernel, op.strides, op.dilations, op.pad_begins, op.pad_ends, 0.0)
    cols = window_view(x, win)                                   # [N, C, OH, OW, KH, KW]
    oh, ow = cols.shape[2:4]
    cols = cols.reshape(n, g, c // g, oh, ow, -1)
    y = np.einsum("ngcopk,ngkop->ngcop", cols, w, optimize=True)
    return y.reshape(n, c, oh, ow).astype(dtype)


def bad_index(indices: np.ndarray, n: int) -> int | None:
    """An index outside [-n, n), or None when every one is inside."""
    idx = np.asarray(indices)
    if idx.size == 0:
        return None
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -n:
        return lo
    if hi >= n:
        return hi
    return None


def _in_range(idx, n: int):
    bad = bad_index(idx, n)
    if bad is not None:
        raise DataError(f"gather index {bad} is out of range for an axis of size {n}")


def run_gather_elements(op: B.GatherElements, args, dtype):
    data, idx = args
    _in_range(idx, data.shape[op.axis])
    idx = np.where(idx < 0, idx + data.shape[op.axis], idx)
    return np.take_along_axis(data, idx, axis=op.axis)


def run_gather(op: B.Gather, args, dtype):
    data, idx = args
    _in_range(idx, data.shape[op.axis])
    idx = np.where(idx < 0, idx + data.shape[op.axis], idx)
    return np.take(data, idx, axis=op.axis)


EXECUTORS = {
    B.Elementwise: run_elementwise,
    B.Broadcast: lambda op, a, dt: np.broadcast_to(a[0], op.shape),
    B.Reduce: run_reduce,
    B.Transpose: lambda op, a, dt: np.transpose(a[0], op.perm),
    B.Reshape: lambda op, a, dt: a[0].reshape(op.shape),
    B.Concat: lambda op, a, dt: np.concatenate(a, axis=op.axis),
    B.Slice: run_slice,
    B.Pad: run_pad,
    B.Gather: run_gather,
    B.GatherElements: run_gather_elements,
    B.Window: lambda op, a, dt: window_view(a[0], op),
    B.MatMul: run_matmul,
    B.Conv: run_conv,
    B.Involution: run_involution,
    B.TypedMatMul: lambda op, a, dt: run_typed_matmul(op, a, dt),
    B.Attention: lambda op, a, dt: run_attention(op, a, dt),
    B.OnnxFallback: lambda op, a, dt: run_onnx_fallback(op, a, dt),
}


def run_attention(op: B.Attention, args, dtype):
    """float32 products and softmax; the probabilities rounded to the operands' type before the
    second product (B.Attention)."""
    q, k, v = (np.asarray(a, np.float32) for a in B.attention_operands(op, [np.asarray(a) for a in args]))
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(op.scale)
    if B.attention_bias(op, args) is not None:
        s = s + np.asarray(args[3], np.float32)
    with np.errstate(invalid="ignore"):
        s = np.exp(s - s.max(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        p = s / s.sum(axis=-1, keepdims=True)
    if op.nan_to_zero:
        p = np.where(np.isnan(p), np.float32(0), p)
    p = p.astype(dtype).astype(np.float32)
    y = (p @ v).astype(dtype)
    y = np.transpose(y, op.out_perm) if op.out_perm else y
    return y.reshape(op.out_shape) if op.out_shape else y


def run_onnx_fallback(op, args, dtype):
    return run_fallback(op, args, dtype)


def run_typed_matmul(op, args, dtype):
    return run_quantized_matmul(op, args, dtype)
