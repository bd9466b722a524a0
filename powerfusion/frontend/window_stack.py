"""Stacked window taps become one Window: a basic-graph rewrite run before the partition.

Involution (RedNet), unfold-style convolutions and hand-written local attention take the K x K
windows of a feature map as K*K shifted slices of its zero-padded copy, each given a new axis and
concatenated along it (`torch.stack(taps, dim=2)`, what `nn.functional.unfold` computes):

    Pad(x) -> Slice(kh, kw) -> Unsqueeze(a) -> Concat(axis a)      (K*K times)

Imported as written, that is K*K slices materialised and a K*K-way concat: the generated kernel
copies every tap separately (49 for a 7x7 window) and the stack is written out before the
multiply that consumes it. The same tensor is one basic `Window` (what pooling and depthwise
convolution use) followed by a free transpose and reshape: the partition then fuses the window
reads into their consumer, and no tap is materialised.

A stack qualifies when every Concat input is a Reshape that inserts a size-1 axis at the concat
axis over a chain of Slices of one source (optionally through a constant-mode Pad of the spatial
axes), the slices cut only the spatial axes (2 ...) with one step per axis and one extent, and the
taps' start offsets are the row-major enumeration of a grid `start = base + k * dilation`. Anything
else is left as it is.
"""
from __future__ import annotations

import itertools

from powerfusion.basic import BasicGraph, BasicNode, Concat, Pad, Reshape, Slice, Transpose, Window
from powerfusion.names import fresh_name


def fold_window_stacks(graph: BasicGraph) -> int:
    """Rewrite `graph` in place; returns how many stacks became Windows."""
    count = 0
    producer = graph.producer()
    for node in [n for n in graph.nodes if isinstance(n.op, Concat)]:
        match = _stack(graph, producer, node)
        if match is None:
            continue
        src, win, perm = match
        _replace(graph, node, src, win, perm)
        producer = graph.producer()
        count += 1
    if count:
        graph.drop_unread()
    return count


def taps_of(graph: BasicGraph, producer, name: str):
    """(source, starts, steps, shape) of a chain of Slices ending at `name`; None if not a chain
    of forward slices."""
    node = producer.get(name)
    if node is None or not isinstance(node.op, Slice):
        return None
    starts, steps = [0] * len(node.op.starts), [1] * len(node.op.starts)
    while node is not None and isinstance(node.op, Slice):
        op = node.op
        if any(s <= 0 for s in op.steps):
            return None
        # outer (already composed) offsets are relative to this slice's output
        starts = [b + s * o for b, s, o in zip(op.starts, op.steps, starts)]
        steps = [s * o for s, o in zip(op.steps, steps)]
        src = node.inputs[0]
        node = producer.get(src)
    return src, tuple(starts), tuple(steps), tuple(graph.tensors[name].shape)


def _stack(graph: BasicGraph, producer, cat: BasicNode):
    """(source, Window, perm) for a Concat of window taps, or None."""
    t = graph.tensors
    axis = cat.op.axis
    taps = []
    for name in cat.inputs:
        r = producer.get(name)
        if r is None or not isinstance(r.op, Reshape):
            return None
        inner = t[r.inputs[0]].shape
        if tuple(t[name].shape) != tuple(inner[:axis]) + (1,) + tuple(inner[axis:]):
            return None
        tap = taps_of(graph, producer, r.inputs[0])
        if tap is None:
            return None
        taps.append(tap)
    found = window_of(graph, producer, taps)
    if found is None:
        return None
    x, win = found
    rank = len(t[taps[0][0]].shape)
    if axis > rank:
        return None
    ns = rank - 2
    plain = list(range(rank))                     # N, C, O... of the window's output
    kaxes = list(range(rank, rank + ns))          # its K... axes
    perm = tuple(plain[:axis] + kaxes + plain[axis:])
    return x, win, perm


def window_of(graph: BasicGraph, producer, taps):
    """(x, Window) whose taps, in row-major order, are `taps` ((source, starts, steps, shape) of
    each), or None."""
    t = graph.tensors
    if len({tp[0] for tp in taps}) != 1 or len({tp[2] for tp in taps}) != 1 or len({tp[3] for tp in taps}) != 1:
        return None
    src, steps, oshape = taps[0][0], taps[0][2], taps[0][3]
    sshape = t[src].shape
    rank = len(sshape)
    if rank < 3 or any(tp[1][d] != 0 for tp in taps for d in (0, 1)) \
            or tuple(oshape[:2]) != tuple(sshape[:2]) or any(steps[d] != 1 for d in (0, 1)):
        return None
    spatial = range(2, rank)
    grid = _grid([tp[1] for tp in taps], spatial)
    if grid is None:
        return None
    base, kernel, dil = grid
    pad_b, value, x = [0] * rank, 0.0, src
    pad = producer.get(src)
    if pad is not None and isinstance(pad.op, Pad) and pad.op.mode == "constant" \
            and all(pad.op.begins[d] == 0 and pad.op.ends[d] == 0 for d in (0, 1)) \
            and all(b >= 0 for b in pad.op.begins) and all(e >= 0 for e in pad.op.ends):
        pad_b, value, x = list(pad.op.begins), float(pad.op.value), pad.inputs[0]
    xshape = t[x].shape
    begins, ends = [], []
    for i, d in enumerate(spatial):
        b = pad_b[d] - base[i]
        reach = (oshape[d] - 1) * steps[d] + (kernel[i] - 1) * dil[i] + 1
        e = reach - xshape[d] - b          # the end padding that gives exactly oshape[d] windows
        if b < 0 or e < 0 or base[i] + reach > sshape[d]:
            return None
        begins.append(b)
        ends.append(e)
    return x, Window(tuple(kernel), tuple(steps[2:]), tuple(dil), tuple(begins), tuple(ends), value)


def _grid(starts, spatial):
    """(base, kernel, dilation) per spatial axis where `starts` enumerate base + k * dilation in
    row-major order of k; None otherwise."""
    base, kernel, dil = [], [], []
    for d in spatial:
        values = sorted({s[d] for s in starts})
        step = values[1] - values[0] if len(values) > 1 else 1
        if any(b - a != step for a, b in zip(values, values[1:])):
            return None
        base.append(values[0])
        kernel.append(len(values))
        dil.append(step)
    want = [tuple(b + k * dl for b, k, dl in zip(base, ks, dil))
            for ks in itertools.product(*(range(k) for k in kernel))]
    if [tuple(s[d] for d in spatial) for s in starts] != want:
        return None
    return base, kernel, dil


def _replace(graph: BasicGraph, cat: BasicNode, x: str, win: Window, perm) -> None:
    t = graph.tensors
    xi, out = t[x], t[cat.outputs[0]]
    oshape = tuple(out.shape)
    wshape = tuple(xi.shape[:2]) + tuple(oshape[d] for d in range(len(oshape)) if d != cat.op.axis)[2:] \
        + tuple(win.kernel)
    tshape = tuple(wshape[p] for p in perm)
    taken = set(t)
    wname, tname = fresh_name(cat.outputs[0] + "_window", taken), fresh_name(cat.outputs[0] + "_taps", taken)
    t[wname] = type(xi)(wname, wshape, xi.dtype)
    t[tname] = type(xi)(tname, tshape, xi.dtype)
    names = {n.name for n in graph.nodes}
    nodes = [BasicNode(fresh_name(cat.name + "_window", names), win, (x,), (wname,), cat.origin),
             BasicNode(fresh_name(cat.name + "_taps", names), Transpose(tuple(perm)), (wname,), (tname,), cat.origin),
             BasicNode(cat.name, Reshape(oshape), (tname,), cat.outputs, cat.origin)]
    i = graph.nodes.index(cat)
    graph.nodes[i:i + 1] = nodes
