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

from powerfusion.basic import (BasicGraph, BasicNode, Broadcast, Concat, Elementwise, Involution, Pad, Reduce,
                              Reshape, Slice, Transpose, Window)


def fold_window_stacks(graph: BasicGraph) -> int:
    """Rewrite `graph` in place; returns how many stacks became Windows."""
    count = 0
    for name in [n.name for n in graph.nodes if isinstance(n.op, Concat)]:
        node = next((n for n in graph.nodes if n.name == name), None)
        if node is None:
            continue
        match = _stack(graph, node)
        if match is None:
            continue
        src, win, perm = match
        _replace(graph, node, src, win, perm)
        count += 1
    if count:
        _drop_dead(graph)
    return count


def _taps(graph: BasicGraph, producer, name: str):
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


def _stack(graph: BasicGraph, cat: BasicNode):
    """(source, Window, perm) for a Concat of window taps, or None."""
    producer, t = graph.producer(), graph.tensors
    axis = cat.op.axis
    taps = []
    for name in cat.inputs:
        r = producer.get(name)
        if r is None or not isinstance(r.op, Reshape):
            return None
        inner = t[r.inputs[0]].shape
        if tuple(t[name].shape) != tuple(inner[:axis]) + (1,) + tuple(inner[axis:]):
            return None
        tap = _taps(graph, producer, r.inputs[0])
        if tap is None:
            return None
        taps.append(tap)
    found = _window(graph, producer, taps)
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


def _window(graph: BasicGraph, producer, taps):
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
    pad_b, pad_e, value, x = [0] * rank, [0] * rank, 0.0, src
    pad = producer.get(src)
    if pad is not None and isinstance(pad.op, Pad) and pad.op.mode == "constant" \
            and all(pad.op.begins[d] == 0 and pad.op.ends[d] == 0 for d in (0, 1)) \
            and all(b >= 0 for b in pad.op.begins) and all(e >= 0 for e in pad.op.ends):
        pad_b, pad_e, value, x = list(pad.op.begins), list(pad.op.ends), float(pad.op.value), pad.inputs[0]
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
    ns = len(win.kernel)
    oshape = tuple(out.shape)
    wshape = tuple(xi.shape[:2]) + tuple(oshape[d] for d in range(len(oshape)) if d != cat.op.axis)[2:] \
        + tuple(win.kernel)
    tshape = tuple(wshape[p] for p in perm)
    wname, tname = _fresh(graph, cat.outputs[0] + "_window"), _fresh(graph, cat.outputs[0] + "_taps")
    t[wname] = type(xi)(wname, wshape, xi.dtype)
    t[tname] = type(xi)(tname, tshape, xi.dtype)
    nodes = [BasicNode(_fresh_node(graph, cat.name + "_window"), win, (x,), (wname,), cat.origin),
             BasicNode(_fresh_node(graph, cat.name + "_taps"), Transpose(tuple(perm)), (wname,), (tname,), cat.origin),
             BasicNode(cat.name, Reshape(oshape), (tname,), cat.outputs, cat.origin)]
    assert len(wshape) == 2 + 2 * ns
    i = graph.nodes.index(cat)
    graph.nodes[i:i + 1] = nodes


def _fresh(graph: BasicGraph, hint: str) -> str:
    name, k = hint, 0
    while name in graph.tensors:
        k += 1
        name = f"{hint}_{k}"
    return name


def _fresh_node(graph: BasicGraph, hint: str) -> str:
    taken = {n.name for n in graph.nodes}
    name, k = hint, 0
    while name in taken:
        k += 1
        name = f"{hint}_{k}"
    return name


def _drop_dead(graph: BasicGraph) -> None:
    """Remove nodes whose outputs nothing reads (the taps' slices and reshapes, an unused Pad)."""
    keep = {o.name for o in graph.outputs}
    while True:
        used = keep | {i for n in graph.nodes for i in n.inputs}
        dead = [n for n in graph.nodes if not any(o in used for o in n.outputs)]
        if not dead:
            return
        graph.nodes = [n for n in graph.nodes if all(n is not d for d in dead)]
        for d in dead:
            for o in d.outputs:
                graph.tensors.pop(o, None)


# ---- involution ------------------------------------------------------------------------------

def fold_involutions(graph: BasicGraph) -> int:
    """ReduceSum over the taps of (window stack x per-position kernel) becomes one Involution
    (GPU targets: its template stages each group's input rows once in shared memory, where the
    folded Window form gathers every tap from global memory). Returns how many were folded.

    The form RedNet's code exports, after `fold_window_stacks`: Window(x) -> Transpose (taps after
    the channels) -> Reshape [N, G, C/G, K*K, *positions] times Broadcast(kernel [N, G, 1, K*K,
    *positions]), summed over the taps axis. Shapes are checked exactly; anything else stays."""
    count = 0
    # last first: the whole sum of a tap-by-tap form before any partial sum inside it
    for name in [n.name for n in graph.nodes if isinstance(n.op, (Reduce, Elementwise))][::-1]:
        node = next((n for n in graph.nodes if n.name == name), None)
        if node is None:
            continue
        match = _involution(graph, node) if isinstance(node.op, Reduce) else _summed_taps(graph, node)
        if match is None:
            continue
        x, kern, op = match
        _replace_involution(graph, node, x, kern, op)
        _drop_dead(graph)
        count += 1
    return count


def _through_reshapes(producer, name: str) -> str:
    node = producer.get(name)
    while node is not None and isinstance(node.op, Reshape):
        name = node.inputs[0]
        node = producer.get(name)
    return name


def _involution(graph: BasicGraph, red: BasicNode):
    """(x, kernel tensor, Involution) where `red` sums window taps times a per-position kernel."""
    t, producer, consumers = graph.tensors, graph.producer(), graph.consumers()
    op = red.op
    if op.fn != "sum" or len(op.axes) != 1 or op.axes[0] != 3 or op.keepdims:
        return None
    mul = producer.get(red.inputs[0])
    if mul is None or not isinstance(mul.op, Elementwise) or mul.op.fn != "mul" or len(mul.inputs) != 2 \
            or len(consumers.get(mul.outputs[0], [])) != 1 or mul.outputs[0] in {o.name for o in graph.outputs}:
        return None
    shape = tuple(t[mul.outputs[0]].shape)
    if len(shape) < 5:
        return None
    for a, b in (mul.inputs, mul.inputs[::-1]):
        win = _window_taps(graph, producer, a, shape)
        kern = _per_position(graph, producer, b, shape)
        if win is not None and kern is not None:
            x, w = win
            op = Involution(w.kernel, w.strides, w.dilations, w.pad_begins, w.pad_ends)
            return x, kern, op
    return None


def _window_taps(graph, producer, name: str, shape):
    """(x, Window) where `name` is Reshape*(Transpose(Window(x))) with the taps right after the
    channels, read as [N, G, C/G, K*K, *positions] = `shape`."""
    t = graph.tensors
    tr = producer.get(_through_reshapes(producer, name))
    if tr is None or not isinstance(tr.op, Transpose) or tr.op.perm != (0, 1, 4, 5, 2, 3):
        return None
    wn = producer.get(tr.inputs[0])
    if wn is None or not isinstance(wn.op, Window) or wn.op.channels_last or wn.op.pad_value != 0.0:
        return None
    n, c, oh, ow, kh, kw = t[wn.outputs[0]].shape
    if shape[0] != n or shape[1] * shape[2] != c or shape[3] != kh * kw or _prod(shape[4:]) != oh * ow:
        return None
    if len(t[wn.inputs[0]].shape) != 4:
        return None
    return wn.inputs[0], wn.op


def _per_position(graph, producer, name: str, shape):
    """The tensor holding [N, G, K*K, *positions] in row-major order where `name` is it broadcast
    over the channels of a group (shape [N, G, 1, K*K, *positions] -> `shape`), or it as is when a
    group has one channel."""
    t = graph.tensors
    node = producer.get(name)
    if node is not None and isinstance(node.op, Broadcast):
        src = node.inputs[0]
        s = tuple(t[src].shape)
        if len(s) != len(shape) or s[2] != 1 or s[:2] != shape[:2] or s[3:] != shape[3:]:
            return None
        return src
    if shape[2] == 1 and tuple(t[name].shape) == shape:
        return name
    return None


def _prod(xs) -> int:
    out = 1
    for v in xs:
        out *= int(v)
    return out


def _replace_involution(graph: BasicGraph, red: BasicNode, x: str, kern: str, op: Involution) -> None:
    t = graph.tensors
    xi = t[x]
    n, c, h, w = xi.shape
    out = t[red.outputs[0]]
    oh = (h + op.pad_begins[0] + op.pad_ends[0] - (op.kernel[0] - 1) * op.dilations[0] - 1) // op.strides[0] + 1
    ow = (w + op.pad_begins[1] + op.pad_ends[1] - (op.kernel[1] - 1) * op.dilations[1] - 1) // op.strides[1] + 1
    groups = t[kern].shape[1]
    kshape = (n, groups, op.kernel[0] * op.kernel[1], oh, ow)
    kname, yname = _fresh(graph, kern + "_kernels"), _fresh(graph, red.outputs[0] + "_involution")
    t[kname] = type(xi)(kname, kshape, t[kern].dtype)
    t[yname] = type(xi)(yname, (n, c, oh, ow), out.dtype)
    nodes = [BasicNode(_fresh_node(graph, red.name + "_kernels"), Reshape(kshape), (kern,), (kname,), red.origin),
             BasicNode(_fresh_node(graph, red.name + "_involution"), op, (x, kname), (yname,), red.origin),
             BasicNode(red.name, Reshape(tuple(out.shape)), (yname,), red.outputs, red.origin)]
    i = graph.nodes.index(red)
    graph.nodes[i:i + 1] = nodes


def _summed_taps(graph: BasicGraph, top: BasicNode):
    """(x, kernel tensor, Involution) where `top` is the last Add of a sum over the taps of a
    window, each tap (a Slice chain of x or of its zero Pad, viewed as [N, G, C/G, *positions])
    times its slice k:k+1 of a kernel tensor [N, G, K*K, *positions] broadcast over the group's
    channels -- involution written tap by tap."""
    t, producer, consumers = graph.tensors, graph.producer(), graph.consumers()
    if top.op.fn != "add" or len(top.inputs) != 2:
        return None
    outputs = {o.name for o in graph.outputs}
    terms, stack = [], [top]
    while stack:               # the add tree's leaves: each inner sum read by its parent only
        node = stack.pop()
        for name in node.inputs:
            p = producer.get(name)
            if p is None or name in outputs or len(consumers.get(name, [])) != 1:
                return None
            if isinstance(p.op, Elementwise) and p.op.fn == "add" and len(p.inputs) == 2:
                stack.append(p)
            elif isinstance(p.op, Elementwise) and p.op.fn == "mul" and len(p.inputs) == 2:
                terms.append(p)
            else:
                return None
    shape = tuple(t[top.outputs[0]].shape)
    if len(shape) < 4 or len(terms) < 2:
        return None
    taps, kern = {}, None
    for m in terms:
        pair = _tap_times_kernel(graph, producer, m, shape)
        if pair is None:
            return None
        tap, k, src = pair
        if (kern is not None and src != kern) or k in taps:
            return None
        kern = src
        taps[k] = tap
    if sorted(taps) != list(range(len(taps))) or t[kern].shape[2] != len(taps):
        return None
    found = _window(graph, producer, [taps[k] for k in range(len(taps))])
    if found is None or len(found[1].kernel) != 2 or found[1].pad_value != 0.0:
        return None
    x, w = found
    return x, kern, Involution(w.kernel, w.strides, w.dilations, w.pad_begins, w.pad_ends)


def _tap_times_kernel(graph, producer, mul: BasicNode, shape):
    """(tap, k, kernel tensor) where `mul` is Reshape*(tap of a window) x Broadcast(kernel[:, :, k:k+1])."""
    t = graph.tensors
    for a, b in (mul.inputs, mul.inputs[::-1]):
        tap = _taps(graph, producer, _through_reshapes(producer, a))
        bc = producer.get(b)
        if tap is None or bc is None or not isinstance(bc.op, Broadcast):
            continue
        sl = producer.get(bc.inputs[0])
        if sl is None or not isinstance(sl.op, Slice) or t[bc.inputs[0]].shape[2] != 1:
            continue
        ks = t[sl.inputs[0]].shape
        cut = [d for d in range(len(ks)) if (sl.op.starts[d], sl.op.stops[d], sl.op.steps[d]) != (0, ks[d], 1)]
        xs = tap[3]
        if cut != [2] or sl.op.steps[2] != 1 or len(ks) != len(shape) or ks[0] != shape[0] or ks[1] != shape[1] \
                or shape[1] * shape[2] != xs[1] or tuple(ks[3:]) != tuple(shape[3:]) or len(xs) != 4 \
                or _prod(xs[2:]) != _prod(shape[3:]) or xs[0] != shape[0]:
            continue
        return tap, sl.op.starts[2], sl.inputs[0]
    return None
