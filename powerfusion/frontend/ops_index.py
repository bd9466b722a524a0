"""Converters for index-computing ONNX ops, decomposed into basic ops.

* ArgMax / ArgMin / Hardmax: the extreme value by a reduce, then the first (or last)
  position holding it by a min (max) reduce over `where(x == extreme, position, sentinel)`.
* ScatterND into a strided box (torch's slice assignment): the data's slices and the updates
  concatenated, or the updates spread by one small Gather per axis and a Where; no index map.
* ScatterND / ScatterElements with other constant indices: the output is a Gather from
  concat(flat data, flat updates) by an index map computed here once (last write wins,
  as in ONNX with reduction 'none'); with a reduction, data is combined with one Gather
  of the updates per round of writes to the same position, in ONNX's order.
* GatherND: the index tuple becomes one flat index by elementwise ops, then a Gather.
* CumSum: a sliding window (the `Window` move) summed; exclusive and reverse by padding
  and reversing slices.
* Trilu: a constant triangular mask and a Where. OneHot: a comparison with positions.
* Range and Size on constants: constants.
"""
from __future__ import annotations

import numpy as np

from powerfusion.basic import Concat, Gather, Slice, Window
from powerfusion.frontend.builder import NodeCtx


def _positions(cx: NodeCtx, shape, axis: int, dtype=np.int64) -> str:
    """A constant 0, 1, ... along `axis`, shaped to broadcast against `shape`."""
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return cx.b.constant(np.arange(shape[axis], dtype=dtype).reshape(view), hint="positions")


def arg_extreme(cx: NodeCtx, x: str, axis: int, largest: bool, last: bool) -> str:
    """Index (int64, keepdims) of the first (last) largest (smallest) element along `axis`."""
    shape = cx.info(x).shape
    m = cx.reduce("max" if largest else "min", x, [axis], True)
    hit = cx.ew("equal", x, m)
    sentinel = cx.scalar(-1 if last else shape[axis], np.int64)
    pos = cx.bcast(_positions(cx, shape, axis), shape)
    cand = cx.ew("where", hit, pos, cx.bcast(sentinel, shape))
    return cx.reduce("max" if last else "min", cand, [axis], True)


def convert_arg(cx: NodeCtx):
    shape = cx.shape(0)
    axis = cx.axis(cx.attr("axis", 0), len(shape))
    idx = arg_extreme(cx, cx.inp(0), axis, cx.op_type == "ArgMax", bool(cx.attr("select_last_index", 0)))
    if cx.attr("keepdims", 1):
        cx.alias(idx, cx.out())
    else:
        cx.reshape(idx, [d for i, d in enumerate(shape) if i != axis], out=cx.out())


def convert_hardmax(cx: NodeCtx):
    shape, dt = cx.shape(0), cx.dtype(0)
    x = cx.inp(0)
    if cx.opset >= 13:
        axis = cx.axis(cx.attr("axis", -1), len(shape))
        flat = x
    else:   # coerced to 2-D at `axis`
        a = cx.axis(cx.attr("axis", 1), len(shape))
        flat = cx.reshape(x, (int(np.prod(shape[:a], dtype=np.int64)), int(np.prod(shape[a:], dtype=np.int64))))
        axis = 1
    idx = arg_extreme(cx, flat, axis, True, False)
    fshape = cx.info(flat).shape
    hit = cx.ew("equal", cx.bcast(_positions(cx, fshape, axis), fshape), idx)
    y = cx.cast(hit, dt)
    cx.reshape(y, shape, out=cx.out())


# ---- scatter / gather -------------------------------------------------------------------

def _wrap(idx: np.ndarray, dims) -> np.ndarray:
    return np.where(idx < 0, idx + np.asarray(dims, dtype=idx.dtype), idx)


def scatter_nd_writes(data_shape, indices: np.ndarray, updates_shape) -> list[tuple[int, int]]:
    """(flat output position, flat update position) of every write, in ONNX's order."""
    k = indices.shape[-1]
    idx = _wrap(indices.astype(np.int64), data_shape[:k])
    block = int(np.prod(data_shape[k:], dtype=np.int64))
    writes = []
    for j, pos in enumerate(np.ndindex(*indices.shape[:-1])):
        start = int(np.ravel_multi_index(tuple(idx[pos]), data_shape[:k])) * block
        writes += [(start + e, j * block + e) for e in range(block)]
    return writes


def scatter_elements_writes(data_shape, indices: np.ndarray, axis: int) -> list[tuple[int, int]]:
    idx = _wrap(indices.astype(np.int64), data_shape[axis])
    writes = []
    for j, pos in enumerate(np.ndindex(*indices.shape)):
        target = list(pos)
        target[axis] = idx[pos]
        writes.append((int(np.ravel_multi_index(tuple(target), data_shape)), j))
    return writes


def scatter_index_maps(size: int, writes) -> list[np.ndarray]:
    """Round r: for each output position, 1 + the update of its r-th write, or 0 (no write)."""
    rounds: list[np.ndarray] = []
    seen = np.zeros(size, dtype=np.int64)
    for target, j in writes:
        r = seen[target]
        if r == len(rounds):
            rounds.append(np.zeros(size, dtype=np.int64))
        rounds[r][target] = 1 + j
        seen[target] += 1
    return rounds


REDUCTIONS = {"add": ("add", 0), "mul": ("mul", 1), "max": ("max", None), "min": ("min", None)}


def scatter_unsupported(cx: NodeCtx) -> str | None:
    reduction = cx.attr("reduction", "none")
    ok = reduction == "none" or reduction in REDUCTIONS
    return None if ok else f"{cx.op_type} with reduction '{reduction}' is not defined"


def _scatter(cx: NodeCtx, writes):
    """reduction 'none': one Gather from concat(data, updates), the last write winning;
    otherwise data op= one Gather of the updates per round of writes (identity where none)."""
    shape, dt = cx.shape(0), cx.dtype(0)
    size = int(np.prod(shape, dtype=np.int64))
    data, updates = cx.inp(0), cx.inp(2)
    reduction = cx.attr("reduction", "none")
    if reduction == "none":
        index_map = np.arange(size, dtype=np.int64)
        for target, j in writes:
            index_map[target] = size + j
        _gather_from(cx, [data, updates], index_map.reshape(shape), cx.out())
        return
    fn, identity = REDUCTIONS[reduction]
    if identity is None:
        low = fn == "max"
        identity = (np.iinfo(dt).min if low else np.iinfo(dt).max) if dt.kind in "iu" else (-np.inf if low else np.inf)
    pool = [cx.b.constant(np.full((1,), identity).astype(dt), hint="identity"), updates]
    rounds = scatter_index_maps(size, writes)
    acc = data
    for k, index_map in enumerate(rounds):
        picked = _gather_from(cx, pool, index_map.reshape(shape), None)
        acc = cx.ew(fn, acc, picked, out=cx.out() if k == len(rounds) - 1 else None)
    if not rounds:
        cx.alias(data, cx.out())


def _gather_from(cx: NodeCtx, sources: list[str], index_map: np.ndarray, out: str | None) -> str:
    flats = [cx.reshape(s, (cx.info(s).size,)) for s in sources]
    total = sum(cx.info(f).size for f in flats)
    pool = flats[0] if len(flats) == 1 else cx.emit(Concat(0), flats, (total,), cx.info(flats[0]).dtype)
    idx = cx.b.constant(index_map.astype(np.int64), hint="index_map")
    return cx.emit(Gather(0), [pool, idx], index_map.shape, cx.info(pool).dtype, out=out)


def convert_scatter_nd(cx: NodeCtx):
    indices = np.asarray(cx.const(1))
    box = scatter_nd_box(cx.shape(0), indices) if cx.attr("reduction", "none") == "none" else None
    if box is not None:
        _scatter_box(cx, *box)
        return
    _scatter(cx, scatter_nd_writes(cx.shape(0), indices, cx.shape(2)))


def scatter_nd_box(data_shape, indices: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(starts, steps) where ScatterND's indices write a strided box of the data's first k axes:
    indices shaped [n_0, .., n_{k-1}, k] with indices[p][j] = start_j + step_j * p_j, every one
    inside its axis; None otherwise. torch's slice assignment (`x[a:b:s] = u`, the dynamo
    exporter's slice_scatter) exports as such a box: arange(a, b, s)[:, None], the sliced axis
    moved first. A box needs no index map the size of the data (_scatter's), only its k axes."""
    k = indices.shape[-1] if indices.ndim else 0
    if k == 0 or indices.ndim != k + 1 or indices.size == 0:
        return None
    dims = np.asarray(data_shape[:k], dtype=np.int64)
    idx = _wrap(indices.astype(np.int64), dims)
    starts = idx[(0,) * k]
    unit = np.eye(k, dtype=np.int64)
    steps = np.array([idx[tuple(unit[j])][j] - starts[j] if indices.shape[j] > 1 else 1 for j in range(k)])
    grid = np.moveaxis(np.indices(indices.shape[:-1]), 0, -1)
    if np.any(steps == 0) or not np.array_equal(idx, starts + steps * grid):
        return None
    last = starts + steps * (np.asarray(indices.shape[:-1]) - 1)
    if np.any(np.minimum(starts, last) < 0) or np.any(np.maximum(starts, last) >= dims):
        return None   # out of range: _scatter's general path reports it
    return tuple(int(s) for s in starts), tuple(int(t) for t in steps)


def _scatter_box(cx: NodeCtx, starts: tuple[int, ...], steps: tuple[int, ...]) -> None:
    """data with a strided box of its first k axes replaced by the updates. One axis, step 1:
    the data's slices either side of the box and the updates, concatenated (data movement
    only). Otherwise the updates spread over the data's extent by one Gather per axis (indices
    of that axis's length), then where(box mask, spread, data), the mask over the k axes only."""
    shape, dt, data, updates = cx.shape(0), cx.dtype(0), cx.inp(0), cx.inp(2)
    counts = cx.shape(2)[:len(starts)]
    if cx.shape(2) != counts + shape[len(starts):]:
        cx.fail(f"updates of shape {cx.shape(2)} do not fit the box {counts} of data {shape}")
    if len(starts) == 1 and steps[0] == 1:
        _concat_around(cx, data, updates, starts[0], counts[0])
        return
    spread, hit = updates, np.ones(shape[:len(starts)], dtype=bool)
    for axis, (start, step, n) in enumerate(zip(starts, steps, counts)):
        positions = start + step * np.arange(n)
        written = np.zeros(shape[axis], dtype=bool)
        written[positions] = True
        view = [1] * len(starts)
        view[axis] = shape[axis]
        hit &= written.reshape(view)
        if n == shape[axis] and start == 0 and step == 1:
            continue   # the whole axis, in order: nothing to spread
        source = np.zeros(shape[axis], dtype=np.int64)
        source[positions] = np.arange(n)
        spread_shape = cx.info(spread).shape[:axis] + (shape[axis],) + cx.info(spread).shape[axis + 1:]
        spread = cx.emit(Gather(axis), [spread, cx.b.constant(source, hint="scatter_source")], spread_shape, dt)
    mask = cx.b.constant(hit.reshape(hit.shape + (1,) * (len(shape) - len(starts))), hint="scatter_mask")
    cx.ew("where", mask, spread, data, out=cx.out())


def _concat_around(cx: NodeCtx, data: str, updates: str, start: int, n: int) -> None:
    """concat(data[:start], updates, data[start + n:]) along axis 0."""
    shape, dt = cx.shape(0), cx.dtype(0)
    rest = tuple(shape[1:])

    def rows(a: int, b: int) -> str:
        return cx.emit(Slice((a,) + (0,) * len(rest), (b,) + rest, (1,) * len(shape)), [data], (b - a,) + rest, dt)

    before = [rows(0, start)] if start > 0 else []
    after = [rows(start + n, shape[0])] if start + n < shape[0] else []
    pieces = before + [updates] + after
    if len(pieces) == 1:
        cx.alias(updates, cx.out())
    else:
        cx.emit(Concat(0), pieces, shape, dt, out=cx.out())


def convert_scatter_elements(cx: NodeCtx):
    shape = cx.shape(0)
    axis = cx.axis(cx.attr("axis", 0), len(shape))
    _scatter(cx, scatter_elements_writes(shape, np.asarray(cx.const(1)), axis))


def convert_gather_nd(cx: NodeCtx):
    data, ind = cx.shape(0), cx.shape(1)
    b = int(cx.attr("batch_dims", 0))
    k = ind[-1]
    if b + k > len(data):
        cx.fail(f"batch_dims {b} + index length {k} exceed the data rank {len(data)}")
    dims = data[b:b + k]
    per_batch = int(np.prod(dims, dtype=np.int64))
    rest = data[b + k:]
    idx = cx.inp(1)
    if cx.dtype(1) != np.dtype(np.int64):
        idx = cx.cast(idx, np.int64)
    # flat = sum_j wrap(idx[..., j]) * stride_j  (+ batch position * per_batch)
    strides = np.array([int(np.prod(dims[j + 1:], dtype=np.int64)) for j in range(k)], dtype=np.int64)
    wrapped = cx.ew("add", idx, cx.ew("mul", cx.cast(cx.ew("less", idx, cx.scalar(0, np.int64)), np.int64),
                                      cx.b.constant(np.asarray(dims, np.int64), hint="dims")))
    flat = cx.reduce("sum", cx.ew("mul", wrapped, cx.b.constant(strides, hint="strides")), [len(ind) - 1], False)
    if b:
        nb = int(np.prod(data[:b], dtype=np.int64))
        base = np.arange(nb, dtype=np.int64).reshape(data[:b] + (1,) * (len(ind) - 1 - b)) * per_batch
        flat = cx.ew("add", flat, cx.b.constant(base, hint="batch_base"))
    table = cx.reshape(cx.inp(0), (int(np.prod(data[:b], dtype=np.int64)) * per_batch,) + rest)
    shape = ind[:-1] + rest
    cx.emit(Gather(0), [table, flat], shape, cx.dtype(0), out=cx.out())


# ---- scans and masks ------------------------------------------------------------------------

def _reverse(cx: NodeCtx, x: str, axis: int) -> str:
    shape = cx.info(x).shape
    starts, stops, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[axis], stops[axis], steps[axis] = shape[axis] - 1, None, -1
    return cx.emit(Slice(tuple(starts), tuple(stops), tuple(steps)), [x], shape, cx.info(x).dtype)


def convert_cumsum(cx: NodeCtx):
    shape = cx.shape(0)
    axis = cx.axis(int(np.asarray(cx.const(1)).reshape(-1)[0]), len(shape))
    n = shape[axis]
    outer, inner = int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis + 1:], dtype=np.int64))
    x = cx.inp(0)
    reverse, exclusive = cx.attr("reverse", 0), cx.attr("exclusive", 0)
    if reverse:
        x = _reverse(cx, x, axis)
    # out[o] = sum of x[o - n + 1 .. o] (inclusive) or x[o - n .. o - 1] (exclusive, one more output)
    view = cx.reshape(x, (outer, 1, n, inner))
    begin = n if exclusive else n - 1
    win = Window((n, 1), (1, 1), (1, 1), (begin, 0), (0, 0), 0.0)
    count = n + 1 if exclusive else n
    w = cx.emit(win, [view], (outer, 1, count, inner, n, 1), cx.dtype(0))
    s = cx.reduce("sum", w, (4, 5), False)
    if exclusive:
        s = cx.emit(Slice((0, 0, 0, 0), (outer, 1, n, inner), (1, 1, 1, 1)), [s], (outer, 1, n, inner), cx.dtype(0))
    if reverse:
        s = _reverse(cx, cx.reshape(s, shape), axis)
    cx.reshape(s, shape, out=cx.out())


def convert_trilu(cx: NodeCtx):
    shape, dt = cx.shape(0), cx.dtype(0)
    k = int(np.asarray(cx.const(1)).reshape(-1)[0]) if cx.has(1) else 0
    ones = np.ones(shape[-2:], dtype=bool)
    mask = np.triu(ones, k) if cx.attr("upper", 1) else np.tril(ones, k)
    m = cx.b.constant(mask, hint="trilu_mask")
    cx.ew("where", m, cx.inp(0), cx.scalar(0, dt), out=cx.out())


def convert_one_hot(cx: NodeCtx):
    ishape = cx.shape(0)
    depth = int(np.asarray(cx.const(1)).reshape(-1)[0])
    rank = len(ishape) + 1
    axis = cx.axis(cx.attr("axis", -1), rank)
    idx = cx.cast(cx.inp(0), np.int64)
    idx = cx.ew("add", idx, cx.ew("mul", cx.cast(cx.ew("less", idx, cx.scalar(0, np.int64)), np.int64),
                                  cx.scalar(depth, np.int64)))
    oshape = list(ishape)
    oshape.insert(axis, depth)
    idx = cx.reshape(idx, [1 if i == axis else d for i, d in enumerate(oshape)])
    hit = cx.ew("equal", idx, _positions(cx, oshape, axis))
    vdt = cx.dtype(2)
    off = cx.emit(Slice((0,), (1,), (1,)), [cx.inp(2)], (1,), vdt)
    on = cx.emit(Slice((1,), (2,), (1,)), [cx.inp(2)], (1,), vdt)
    cx.ew("where", hit, on, off, out=cx.out())


def convert_top_k(cx: NodeCtx):
    """Sorted top-k by ranks: rank_i = #{j: x_j beats x_i} + #{j < i: x_j == x_i} (an [L, L]
    comparison, so meant for short axes), then the index of rank r for r < k, and a
    GatherElements for the values. Ties go to the lower index, as in ONNX."""
    shape = cx.shape(0)
    axis = cx.axis(cx.attr("axis", -1), len(shape))
    k = int(np.asarray(cx.const(1)).reshape(-1)[0])
    n = shape[axis]
    if not 0 <= k <= n:
        cx.fail(f"k={k} is outside 0..{n}")
    perm = [i for i in range(len(shape)) if i != axis] + [axis]
    x = cx.transpose(cx.inp(0), perm)
    lead = cx.info(x).shape[:-1]
    xi = cx.reshape(x, lead + (n, 1))
    xj = cx.reshape(x, lead + (1, n))
    beats = cx.ew("greater" if cx.attr("largest", 1) else "less", xj, xi)
    before = cx.b.constant(np.tril(np.ones((n, n), dtype=bool), -1), hint="before")   # [i, j]: j < i
    tie = cx.ew("and", cx.ew("equal", xj, xi), before)
    rank = cx.reduce("sum", cx.cast(cx.ew("or", beats, tie), np.int64), [len(lead) + 1], False)   # [.., L]
    ranks = cx.reshape(rank, lead + (n, 1))
    wanted = cx.b.constant(np.arange(k, dtype=np.int64).reshape(1, k), hint="ranks")
    hit = cx.ew("equal", ranks, wanted)                                                          # [.., L, k]
    positions = cx.b.constant(np.arange(n, dtype=np.int64).reshape(n, 1), hint="positions")
    picked = cx.ew("where", hit, positions, cx.scalar(0, np.int64))
    idx = cx.reduce("sum", picked, [len(lead)], False)                                           # [.., k]
    from powerfusion.basic import GatherElements
    values = cx.emit(GatherElements(len(lead)), [x, idx], lead + (k,), cx.dtype(0))
    inverse = [perm.index(i) for i in range(len(shape))]
    cx.transpose(values, inverse, out=cx.out(0))
    if cx.out(1):
        cx.transpose(idx, inverse, out=cx.out(1))


def convert_range(cx: NodeCtx):
    start, limit, delta = (np.asarray(cx.const(i)).reshape(()) for i in range(3))
    n = max(int(np.ceil((limit - start) / delta)), 0)
    cx.b.constant((start + np.arange(n) * delta).astype(start.dtype), name=cx.out())


def convert_size(cx: NodeCtx):
    cx.b.constant(np.array(int(np.prod(cx.shape(0), dtype=np.int64)), dtype=np.int64), name=cx.out())


CONVERTERS = {
    "ArgMax": convert_arg, "ArgMin": convert_arg, "Hardmax": convert_hardmax, "ScatterND": convert_scatter_nd,
    "ScatterElements": convert_scatter_elements, "GatherND": convert_gather_nd, "CumSum": convert_cumsum,
    "Trilu": convert_trilu, "OneHot": convert_one_hot, "TopK": convert_top_k, "Range": convert_range, "Size": convert_size,
}
CHECKS = {"ScatterND": scatter_unsupported, "ScatterElements": scatter_unsupported}
CONST_INPUTS = {"ScatterND": (1,), "ScatterElements": (1,), "CumSum": (1,), "Trilu": (1,), "OneHot": (1,),
                "Range": (0, 1, 2), "TopK": (1,)}
