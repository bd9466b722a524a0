"""Channels-last convolutions: a basic-graph rewrite that runs 2-D library convolutions on NHWC
tensors and moves the layout change away from them.

Why: cuDNN's tensor-core engines for fp16 / bf16 read and write NHWC. Handed NCHW tensors,
they transpose on the way in and out (measured on the H100 in ResNet-18 fp16: 48 us of
`nchwToNhwc` / `nhwcToNchw` kernels in a 332 us run), and our im2col + cuBLAS route is no
faster. torch.compile converts such models to channels-last for the same reason.

How: each chosen Conv becomes Transpose(NCHW -> NHWC) -> Conv(channels_last) -> Transpose(back),
its weight constant stored KRSC. Then transposes sink: a Transpose whose every consumer can
compute in the transposed layout (elementwise ops whose other operands are transposed the same
way or broadcast constants, broadcasts, pooling windows, reductions, other transposes) is moved below them, and a Transpose
meeting its inverse vanishes. An operand the graph already transposes the inverse way ahead of
the consumer (the residual stream of ConvNeXt, read NHWC by its depthwise conv) is taken in
that layout, so the transpose sinks through the residual add too. Between two convolutions of
a ResNet block, the BatchNorm, ReLU and residual Add then run on NHWC data and no layout change
is left; where one remains (before pooling windows, reshapes, the classifier), it is a move the
memory-bound kernel around it fuses. The graph computes the same values: only the order of elements in memory changes.
"""
from __future__ import annotations

import numpy as np

import dataclasses

from powerfusion.basic import (BasicGraph, BasicNode, Broadcast, Conv, Elementwise, Reduce, TensorInfo, Transpose,
                               Window)

TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)
LOW_PRECISION = ("float16", "bfloat16")


def wants_channels_last(graph: BasicGraph, node: BasicNode, consumers: dict | None = None) -> bool:
    """A 2-D fp16 / bf16 Conv with a constant weight that is not an image's patch embedding
    (kernel equal to stride, larger than 1x1, no padding, at most 4 input channels: ViT's
    16x16 / 16 stem, ConvNeXt's 4x4 / 4). Such a stem is a GEMM over disjoint patches: on NCHW
    the CUDA session times cuDNN against im2col + cuBLAS and keeps the faster, where
    channels-last leaves cuDNN alone (measured on the H200, ViT-B/16 fp16: cuDNN's NHWC engine
    for the 16x16 / 16 stem took 58 us of a 951 us run).

    A depthwise conv (a memory-bound GIR template) goes channels-last only where the model
    itself moves its result to NHWC (every reader a Transpose (0, 2, 3, 1): ConvNeXt's block,
    whose LayerNorm and Linear layers run channels-last); it then runs as conv.depthwise.cols
    with its lanes along C. Elsewhere it stays NCHW, where the strip and stencil templates reuse
    the window in registers or shared memory: measured on the H200 (fp16), channels-last
    depthwise convs took ConvNeXt-T batch 8 from 1334 to 1036 us but EfficientNet-B0 batch 8
    from 1074 to 1556 us and MobileNetV3-Small from 402 to 472 us."""
    op = node.op
    if not isinstance(op, Conv) or op.channels_last or len(op.strides) != 2:
        return False
    x, w = graph.tensors[node.inputs[0]], graph.tensors[node.inputs[1]]
    if np.dtype(x.dtype).name not in LOW_PRECISION or node.inputs[1] not in graph.constants:
        return False
    if _depthwise(graph, node):
        readers = (consumers if consumers is not None else graph.consumers()).get(node.outputs[0], [])
        return bool(readers) and all(isinstance(r.op, Transpose) and tuple(r.op.perm) == TO_NHWC for r in readers)
    patches = tuple(w.shape[2:]) == tuple(op.strides) != (1, 1) and not any(op.pad_begins) and not any(op.pad_ends) \
        and all(d == 1 for d in op.dilations) and x.shape[1] <= 4
    return not patches


def _depthwise(graph: BasicGraph, node: BasicNode) -> bool:
    """One input channel per group and one output channel per group (what the GIR templates
    take: partition.has_gir_template); with a channel multiplier a conv stays the library's."""
    op, x, w = node.op, graph.tensors[node.inputs[0]], graph.tensors[node.inputs[1]]
    return op.group > 1 and op.group == x.shape[1] and w.shape[1] == 1 and w.shape[0] == op.group


def to_channels_last(graph: BasicGraph) -> int:
    """Rewrite `graph` in place as the module docstring says; returns how many convolutions
    now run channels-last (0: the graph is unchanged)."""
    consumers = graph.consumers()
    convs = [n for n in graph.nodes if wants_channels_last(graph, n, consumers)]
    if not convs:
        return 0
    r = _Rewriter(graph)
    for node in convs:
        r.wrap_conv(node)
    while r.sink_one():
        pass
    r.drop_dead()
    return len(convs)


def _compose(p: tuple[int, ...], q: tuple[int, ...]) -> tuple[int, ...]:
    """x.transpose(p).transpose(q) == x.transpose(_compose(p, q))."""
    return tuple(p[i] for i in q)


def _from_last(rank: int) -> tuple[int, ...]:
    """The perm that moves the last axis to position 1 (NHWC -> NCHW at any rank)."""
    return (0, rank - 1, *range(1, rank - 1))


def _inverse(p: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(p))


class _Rewriter:
    def __init__(self, graph: BasicGraph):
        self.g = graph
        self.serial = 0
        self.taken = {n.name for n in graph.nodes} | set(graph.tensors)   # node and tensor names

    # ---- names and nodes ---------------------------------------------------------------
    def _name(self, base: str) -> str:
        while True:
            self.serial += 1
            name = f"{base}_cl{self.serial}"
            if name not in self.taken and name not in self.g.tensors:
                self.taken.add(name)
                return name

    def _tensor(self, base: str, shape, dtype) -> str:
        name = self._name(base)
        self.g.tensors[name] = TensorInfo(name, tuple(int(d) for d in shape), dtype)
        return name

    def _constant(self, base: str, value: np.ndarray) -> str:
        name = self._tensor(base, value.shape, value.dtype)
        self.g.constants[name] = np.asarray(value, order="C")
        return name

    def _transposed(self, src: str, perm: tuple[int, ...], out: str | None, origin) -> BasicNode:
        info = self.g.tensors[src]
        shape = tuple(info.shape[i] for i in perm)
        out = out or self._tensor(src, shape, info.dtype)
        return BasicNode(self._name("transpose"), Transpose(perm), (src,), (out,), origin)

    def _replace(self, old: BasicNode, new: list[BasicNode]) -> None:
        i = next(k for k, n in enumerate(self.g.nodes) if n is old)
        self.g.nodes[i:i + 1] = new

    # ---- the conv ----------------------------------------------------------------------
    def wrap_conv(self, node: BasicNode) -> None:
        g, op = self.g, node.op
        x, w = node.inputs[0], node.inputs[1]
        to_nhwc = self._transposed(x, TO_NHWC, None, node.origin)
        pre = []
        if _depthwise(g, node):
            # depthwise: the weight stored [1, *K, C] (the channel, along which the template's
            # lanes run, innermost), read as KRSC [C, *K, 1] through a Transpose the lowering
            # folds into the conv's weight loads: a warp's tap then reads 32 adjacent weights
            # instead of 32 scattered ones (KRSC would put the channels KH * KW apart)
            rank = g.constants[w].ndim
            stored = self._constant(w, g.constants[w].transpose((*range(1, rank), 0)))
            read = self._transposed(stored, (rank - 1, *range(1, rank - 1), 0), None, node.origin)
            pre, w_krsc = [read], read.outputs[0]
        else:
            w_krsc = self._constant(w, g.constants[w].transpose(TO_NHWC))
        y = g.tensors[node.outputs[0]]
        y_nhwc = self._tensor(y.name, tuple(y.shape[i] for i in TO_NHWC), y.dtype)
        conv = BasicNode(node.name, Conv(op.strides, op.pad_begins, op.pad_ends, op.dilations, op.group, True),
                         (to_nhwc.outputs[0], w_krsc, *node.inputs[2:]), (y_nhwc,), node.origin)
        back = self._transposed(y_nhwc, TO_NCHW, y.name, node.origin)
        self._replace(node, [to_nhwc, *pre, conv, back])

    # ---- sinking -----------------------------------------------------------------------
    def sink_one(self) -> bool:
        """Move one Transpose below all its consumers (or cancel it against one); False when
        no Transpose can move."""
        producer = self.g.producer()
        consumers = self.g.consumers()
        outputs = {t.name for t in self.g.outputs}
        # the graph's transposes as they stand (for _before_transposed; an absorbed Transpose
        # user keeps its output's name, so the entries stay true while this sink completes)
        self._order = {id(n): i for i, n in enumerate(self.g.nodes)}
        self._transposes: dict[tuple, tuple[int, str]] = {}
        for i, n in enumerate(self.g.nodes):
            if isinstance(n.op, Transpose):
                self._transposes.setdefault((n.inputs[0], tuple(n.op.perm)), (i, n.outputs[0]))
        for node in self.g.nodes:
            if not isinstance(node.op, Transpose) or node.outputs[0] in outputs:
                continue
            users = consumers.get(node.outputs[0], [])
            if users and all(self._can_absorb(u, node, producer, outputs) for u in users):
                for u in users:
                    self._absorb(u, node, producer)
                self.g.nodes.remove(node)
                return True
        return False

    def _source(self, t: str, perm, producer) -> str | None:
        """`t` as it is before transposing by `perm`, if that is at hand: the input of a
        Transpose by `perm`, or None."""
        p = producer.get(t)
        if p is not None and isinstance(p.op, Transpose) and tuple(p.op.perm) == tuple(perm):
            return p.inputs[0]
        return None

    def _before_transposed(self, t: str, perm, before: BasicNode) -> str | None:
        """`t` in the layout before `perm` where the graph already computes it ahead of `before`:
        the output of a Transpose of `t` by the inverse of `perm` (ConvNeXt: the residual stream
        that a channels-last depthwise conv already reads transposed to NHWC)."""
        hit = self._transposes.get((t, _inverse(perm)))
        return hit[1] if hit is not None and hit[0] < self._order[id(before)] else None

    def _broadcast_constant(self, t: str, producer) -> bool:
        p = producer.get(t)
        return p is not None and isinstance(p.op, Broadcast) and p.inputs[0] in self.g.constants

    def _can_absorb(self, user: BasicNode, tr: BasicNode, producer, outputs) -> bool:
        if isinstance(user.op, Transpose):
            return True
        if any(o in outputs for o in user.outputs) or len(user.outputs) != 1:
            return False
        perm = tr.op.perm
        if isinstance(user.op, Reduce):
            return True
        if isinstance(user.op, Broadcast):   # e.g. a squeeze-excitation gate over the feature map
            return len(user.op.shape) == len(perm)
        if isinstance(user.op, Window):      # pooling on channels-last data
            return not user.op.channels_last and tuple(perm) == _from_last(len(perm))
        if isinstance(user.op, Elementwise):
            return all(self._source(t, perm, producer) is not None or self._broadcast_constant(t, producer)
                       or (t in self.g.constants and self.g.constants[t].ndim == len(perm))
                       or self._before_transposed(t, perm, user) is not None
                       for t in user.inputs)
        return False

    def _absorb(self, user: BasicNode, tr: BasicNode, producer) -> None:
        perm, src = tuple(tr.op.perm), tr.inputs[0]
        if isinstance(user.op, Transpose):
            self._replace(user, [self._transposed(src, _compose(perm, tuple(user.op.perm)), user.outputs[0],
                                                  user.origin)])
            return
        out = self.g.tensors[user.outputs[0]]
        if isinstance(user.op, Reduce):
            self._absorb_reduce(user, perm, src, out)
            return
        if isinstance(user.op, Window):
            ns = len(user.op.kernel)
            shape = (out.shape[0], *out.shape[2:], out.shape[1])   # [N, *O, *K, C]
            inner = self._tensor(out.name, shape, out.dtype)
            moved = BasicNode(user.name, dataclasses.replace(user.op, channels_last=True), (src,), (inner,),
                              user.origin)
            self._replace(user, [moved, self._transposed(inner, _from_last(2 * ns + 2), out.name, user.origin)])
            return
        if isinstance(user.op, Broadcast):
            shape = tuple(user.op.shape[i] for i in _inverse(perm))
            inner = self._tensor(out.name, shape, out.dtype)
            moved = BasicNode(user.name, Broadcast(shape), (src,), (inner,), user.origin)
            self._replace(user, [moved, self._transposed(inner, perm, out.name, user.origin)])
            return
        pre, ins = [], []
        for t in user.inputs:
            s = src if t == tr.outputs[0] else self._source(t, perm, producer)
            if s is None and not (t in self.g.constants or self._broadcast_constant(t, producer)):
                s = self._before_transposed(t, perm, user)
            if s is None:
                s, made = self._untransposed_operand(t, perm, producer, user.origin)
                pre.extend(made)
            ins.append(s)
        inner = self._tensor(out.name, tuple(self.g.tensors[src].shape), out.dtype)
        moved = BasicNode(user.name, user.op, tuple(ins), (inner,), user.origin)
        self._replace(user, [*pre, moved, self._transposed(inner, perm, out.name, user.origin)])

    def _untransposed_operand(self, t: str, perm, producer, origin) -> tuple[str, list[BasicNode]]:
        """A broadcast constant or a full constant in the layout before `perm`."""
        inv = _inverse(perm)
        if t in self.g.constants:
            return self._constant(t, self.g.constants[t].transpose(inv)), []
        b = producer[t]
        c = self.g.constants[b.inputs[0]]
        rank = len(perm)
        aligned = c.reshape((1,) * (rank - c.ndim) + c.shape)
        const = self._constant(b.inputs[0], aligned.transpose(inv))
        shape = tuple(b.op.shape[i] for i in inv)
        out = self._tensor(t, shape, self.g.tensors[t].dtype)
        return out, [BasicNode(self._name(b.name), Broadcast(shape), (const,), (out,), origin)]

    def _absorb_reduce(self, user: BasicNode, perm, src: str, out: TensorInfo) -> None:
        op = user.op
        axes = tuple(sorted(perm[a] for a in op.axes))
        if op.keepdims:
            after = perm
            shape = tuple(1 if i in axes else d for i, d in enumerate(self.g.tensors[src].shape))
        else:   # the kept axes of src, in src's order, then reordered as perm keeps them
            kept = [a for a in range(len(perm)) if a not in axes]
            after = tuple(kept.index(p) for p in perm if p in kept)
            shape = tuple(self.g.tensors[src].shape[a] for a in kept)
        inner = self._tensor(out.name, shape, out.dtype)
        moved = BasicNode(user.name, Reduce(op.fn, axes, op.keepdims), (src,), (inner,), user.origin)
        tail = [self._transposed(inner, after, out.name, user.origin)]
        self._replace(user, [moved, *tail])

    def drop_dead(self) -> None:
        """Nodes nothing reads any more, identity transposes renamed away where possible."""
        outputs = {t.name for t in self.g.outputs}
        for node in list(self.g.nodes):
            if isinstance(node.op, Transpose) and tuple(node.op.perm) == tuple(range(len(node.op.perm))) \
                    and node.outputs[0] not in outputs:
                self._rename(node.outputs[0], node.inputs[0])
                self.g.nodes.remove(node)
        self.g.drop_unread()

    def _rename(self, old: str, new: str) -> None:
        self.g.nodes[:] = [BasicNode(n.name, n.op, tuple(new if t == old else t for t in n.inputs), n.outputs,
                                     n.origin) for n in self.g.nodes]
