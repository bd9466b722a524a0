"""Involution (RedNet's: a K x K kernel per output position and channel group) becomes one
basic op, `B.Involution`: a basic-graph rewrite run before the partition on GPU targets, after
`window_stack.fold_window_stacks` (docs/gir.md, "Strips"). Two forms are recognised, shapes
checked exactly; anything else stays as written:

* stacked taps (RedNet's code, `torch.stack` of unfold taps): Window(x) -> Transpose (taps after
  the channels) -> Reshape [N, G, C/G, K*K, *positions], times the kernel broadcast over the
  group's channels [N, G, 1, K*K, *positions], summed over the taps axis;
* tap by tap: a sum over the taps of each tap (a Slice chain of x or of its zero Pad) viewed as
  [N, G, C/G, *positions] times the kernel's slice k:k+1, k the tap's row-major index.
"""
from __future__ import annotations

import math

from powerfusion.basic import BasicGraph, BasicNode, Broadcast, Elementwise, Involution, Reduce, Reshape, Slice, \
    Transpose, Window
from powerfusion.frontend.window_stack import taps_of, window_of
from powerfusion.names import fresh_name


def fold_involutions(graph: BasicGraph) -> int:
    """Rewrite `graph` in place; returns how many involutions became one op (its templates load
    x's window once per lane, where the Window form gathers every tap: docs/gir.md)."""
    count = 0
    maps = (graph.producer(), graph.consumers())
    # last first: the whole sum of a tap-by-tap form before any partial sum inside it
    for node in [n for n in graph.nodes if _candidate(n)][::-1]:
        if maps[0].get(node.outputs[0]) is not node:
            continue   # dropped with an earlier fold
        match = _involution(graph, maps, node) if isinstance(node.op, Reduce) else _summed_taps(graph, maps, node)
        if match is None:
            continue
        x, kern, op = match
        _replace_involution(graph, node, x, kern, op)
        graph.drop_unread()
        maps = (graph.producer(), graph.consumers())
        count += 1
    return count


def _candidate(node: BasicNode) -> bool:
    """Where an involution can end: a sum over one axis, or an Add."""
    op = node.op
    return (isinstance(op, Reduce) and op.fn == "sum" and len(op.axes) == 1) or \
        (isinstance(op, Elementwise) and op.fn == "add" and len(node.inputs) == 2)


def _through_reshapes(producer, name: str) -> str:
    node = producer.get(name)
    while node is not None and isinstance(node.op, Reshape):
        name = node.inputs[0]
        node = producer.get(name)
    return name


def _involution(graph: BasicGraph, maps, red: BasicNode):
    """(x, kernel tensor, Involution) where `red` sums window taps times a per-position kernel."""
    t, (producer, consumers) = graph.tensors, maps
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
        win = _windowtaps_of(graph, producer, a, shape)
        kern = _per_position(graph, producer, b, shape)
        if win is not None and kern is not None:
            x, w = win
            op = Involution(w.kernel, w.strides, w.dilations, w.pad_begins, w.pad_ends)
            return x, kern, op
    return None


def _windowtaps_of(graph, producer, name: str, shape):
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
    if shape[0] != n or shape[1] * shape[2] != c or shape[3] != kh * kw or math.prod(shape[4:]) != oh * ow:
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


def _replace_involution(graph: BasicGraph, red: BasicNode, x: str, kern: str, op: Involution) -> None:
    t = graph.tensors
    xi = t[x]
    n, c, h, w = xi.shape
    out = t[red.outputs[0]]
    oh = (h + op.pad_begins[0] + op.pad_ends[0] - (op.kernel[0] - 1) * op.dilations[0] - 1) // op.strides[0] + 1
    ow = (w + op.pad_begins[1] + op.pad_ends[1] - (op.kernel[1] - 1) * op.dilations[1] - 1) // op.strides[1] + 1
    groups = t[kern].shape[1]
    kshape = (n, groups, op.kernel[0] * op.kernel[1], oh, ow)
    taken, names = set(t), {n.name for n in graph.nodes}
    kname, yname = fresh_name(kern + "_kernels", taken), fresh_name(red.outputs[0] + "_involution", taken)
    t[kname] = type(xi)(kname, kshape, t[kern].dtype)
    t[yname] = type(xi)(yname, (n, c, oh, ow), out.dtype)
    nodes = [BasicNode(fresh_name(red.name + "_kernels", names), Reshape(kshape), (kern,), (kname,), red.origin),
             BasicNode(fresh_name(red.name + "_involution", names), op, (x, kname), (yname,), red.origin),
             BasicNode(red.name, Reshape(tuple(out.shape)), (yname,), red.outputs, red.origin)]
    i = graph.nodes.index(red)
    graph.nodes[i:i + 1] = nodes


def _summed_taps(graph: BasicGraph, maps, top: BasicNode):
    """(x, kernel tensor, Involution) where `top` is the last Add of a sum over the taps of a
    window, each tap (a Slice chain of x or of its zero Pad, viewed as [N, G, C/G, *positions])
    times its slice k:k+1 of a kernel tensor [N, G, K*K, *positions] broadcast over the group's
    channels -- involution written tap by tap."""
    t, (producer, consumers) = graph.tensors, maps
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
    found = window_of(graph, producer, [taps[k] for k in range(len(taps))])
    if found is None or len(found[1].kernel) != 2 or found[1].pad_value != 0.0:
        return None
    x, w = found
    return x, kern, Involution(w.kernel, w.strides, w.dilations, w.pad_begins, w.pad_ends)


def _tap_times_kernel(graph, producer, mul: BasicNode, shape):
    """(tap, k, kernel tensor) where `mul` is Reshape*(tap of a window) x Broadcast(kernel[:, :, k:k+1])."""
    t = graph.tensors
    for a, b in (mul.inputs, mul.inputs[::-1]):
        tap = taps_of(graph, producer, _through_reshapes(producer, a))
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
                or math.prod(xs[2:]) != math.prod(shape[3:]) or xs[0] != shape[0]:
            continue
        return tap, sl.op.starts[2], sl.inputs[0]
    return None
