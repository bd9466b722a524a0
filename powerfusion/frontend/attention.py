"""Fused attention: a basic-graph rewrite that finds softmax(Q K^T * s + bias) V in the ops the
importer decomposed it into and replaces them by one `Attention` library op (basic.py).

Why: a transformer layer's attention decomposed is two batched GEMMs with a memory-bound
softmax between them, and the scores make a round trip through DRAM. cuDNN's fused attention
(flash attention: scores stay on chip) does it in one kernel; torch.compile calls it for the
same models. Measured on the H200 before this rewrite (benchmarks/results/zoo-profile.md):
ViT-B/16 fp16 spent 157 us of 878 in the two align-1 GEMMs around 197-wide softmax rows,
GPT-2 fp16 about 10 us a layer in the two GEMMs, the softmax and the transpose after it.

What is matched (the importer's own decomposition, frontend/ops_nn.py):

    S  = MatMul(Q, K, trans_b)                      Q [..., Sq, D], K [..., Skv, D]
    S' = S * c | S / c                              optional, c a scalar constant
    S''= S' + bias                                  optional, bias broadcast to S's shape
    x  = cast(S'', float32)                         optional (fp16 / bf16 softmax upcast)
    P  = exp(x - max(x)) * reciprocal(sum(exp(..))) over the last axis
    P' = cast(P, Q's type)                          optional
    P''= where(isnan(P'), 0, P')                    optional (Attention.nan_to_zero)
    Y  = MatMul(P'', V)

Only where every intermediate is used inside the pattern alone (no other consumer, not a graph
output), the operands have equal leading dims, and either they are fp16 / bf16 and the head
size suits cuDNN (a multiple of 8, at most 128), or they are float32 with at most
MAX_DECODE_ROWS query rows, no bias and a power-of-two head size up to 128: a decode step
(one token; or the G query heads of grouped-query attention that share one KV head, Q stored
[B, Hkv, G, D]), which the split-KV kernel runs (backends/cuda/decode_attention.py). Only run
for CUDA targets (pipeline/driver.py); the CUDA session runs decode shapes through that
kernel, the rest through cuDNN and, where neither takes it, through cuBLAS + CuPy.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from powerfusion.basic import (Attention, BasicGraph, BasicNode, Broadcast, Elementwise, MatMul, Reduce, Reshape,
                               Slice, Transpose)

LOW_PRECISION = ("float16", "bfloat16")
MAX_HEAD = 128
# float32 attentions are fused only where the split-KV decode kernel runs them: at most this
# many query rows (one token, or the G query heads that share a KV head), these head sizes
MAX_DECODE_ROWS = 8
DECODE_HEADS = (8, 16, 32, 64, 128)


def fuse_attention(graph: BasicGraph) -> int:
    """Rewrite `graph` in place; returns how many attentions were fused."""
    count = 0
    while True:
        match = _find(graph)
        if match is None:
            return count
        _replace(graph, *match)
        count += 1


def read_through_reshapes(graph: BasicGraph) -> int:
    """Let each Attention read past a Reshape that only it reads (a Reshape keeps the bytes of a
    contiguous tensor, so an operand's permutation or view of the reshaped tensor is a view of the
    tensor before it). Run after frontend/gemm_bias.py, which can leave a fused QKV projection's
    reshape as the only op between the GEMM and the attention. Returns how many were read past."""
    count = 0
    for name in [n.name for n in graph.nodes if isinstance(n.op, Attention)]:
        while step := _past_reshapes(graph, next(n for n in graph.nodes if n.name == name)):
            count += step   # a chain of Reshapes: one at a time
    return count


def _past_reshapes(graph: BasicGraph, att: BasicNode) -> int:
    producer, consumers = graph.producer(), graph.consumers()
    outputs = {x.name for x in graph.outputs}
    ins, views, count = list(att.inputs), list(att.op.in_views or ((),) * 3), 0
    for k in range(3):
        r = producer.get(ins[k])
        if r is None or not isinstance(r.op, Reshape) or ins[k] in outputs or \
                any(c is not att for c in consumers.get(ins[k], [])):
            continue
        if not views[k]:
            perm = att.op.in_perms[k] if att.op.in_perms else ()
            views[k] = _perm_view(graph.tensors[ins[k]].shape, perm)
        count += 1
    if not count:
        return 0
    for k in range(3):
        r = producer.get(ins[k])
        if views[k] and r is not None and isinstance(r.op, Reshape) and all(c is att for c in consumers.get(ins[k], [])):
            ins[k] = r.inputs[0]
    gone = {att.inputs[k] for k in range(3) if ins[k] != att.inputs[k]}
    for t in gone:
        graph.tensors.pop(t, None)
    op = dataclasses.replace(att.op, in_perms=(), in_views=tuple(views))
    fused = BasicNode(att.name, op, tuple(ins), att.outputs, att.origin)
    graph.nodes = [fused if n is att else n for n in graph.nodes
                   if not (isinstance(n.op, Reshape) and n.outputs[0] in gone)]
    return count


def _perm_view(shape, perm) -> tuple:
    """(offset, shape, strides) of a contiguous tensor of `shape` viewed with leading 1s to the
    rank of `perm` and transposed by it (no perm: as it is, at least rank 4)."""
    shape = tuple(int(d) for d in shape)
    if not perm:
        return 0, shape, _row_major(shape)
    padded = (1,) * (len(perm) - len(shape)) + shape
    row = _row_major(padded)
    return 0, tuple(padded[a] for a in perm), tuple(row[a] for a in perm)


def _find(graph: BasicGraph):
    producer, consumers = graph.producer(), graph.consumers()
    outputs = {t.name for t in graph.outputs}
    for pv in graph.nodes:
        if not isinstance(pv.op, MatMul) or pv.op.trans_a or pv.op.trans_b:
            continue
        m = _Match(graph, producer, consumers, outputs)
        got = m.attention(pv)
        if got is not None:
            return (pv, *got, m.chain)
    return None


class _Match:
    def __init__(self, graph, producer, consumers, outputs):
        self.g, self.producer, self.consumers, self.outputs = graph, producer, consumers, outputs
        self.chain: list[BasicNode] = []

    def node(self, t: str, kind, uses: int = 1) -> BasicNode | None:
        """The producer of `t` if it is a `kind` op and `t` has exactly `uses` consumers and is no
        graph output (it will vanish with the pattern)."""
        n = self.producer.get(t)
        if n is None or not isinstance(n.op, kind) or t in self.outputs:
            return None
        if len(self.consumers.get(t, [])) != uses:
            return None
        return n

    def take(self, n: BasicNode) -> BasicNode:
        if n not in self.chain:
            self.chain.append(n)
        return n

    def attention(self, pv: BasicNode):
        p, v = pv.inputs
        self.nan_to_zero = False
        p = self._nan_guard(p)
        uses = 2 if self.nan_to_zero else 1
        n = self.node(p, Elementwise, uses=uses)
        if n is not None and n.op.fn == "cast":
            p = self.take(n).inputs[0]
            n = self.node(p, Elementwise)
        elif n is None and uses == 2:
            return None
        if n is None or n.op.fn != "mul":
            return None
        self.take(n)
        x = self._softmax(n)
        if x is None:
            return None
        n = self.node(x, Elementwise, uses=2)   # the softmax's upcast, read by max and sub
        uses = 2                                 # x's readers: the softmax's max and sub
        if n is not None and n.op.fn == "cast":
            x, uses = self.take(n).inputs[0], 1
        base = list(self.chain)
        for bias, scores, taken in self._bias_options(x, uses):
            scale, scores, scaled = self._scale(scores, uses if not taken else 1)
            qk = self.node(scores, MatMul)
            if qk is None or qk.op.trans_a or not qk.op.trans_b:
                continue
            q, k = qk.inputs
            if self._shapes_ok(q, k, v, pv.outputs[0], bias):
                self.chain = base + taken + scaled + [qk]
                return q, k, v, bias, scale, self.nan_to_zero
        return None

    def _nan_guard(self, p: str) -> str:
        """where(isnan(p), 0, p) (the exporters' guard for fully masked rows): p, taken."""
        w = self.node(p, Elementwise)
        if w is None or w.op.fn != "where" or len(w.inputs) != 3:
            return p
        cond, zero, x = w.inputs
        isnan = self.node(cond, Elementwise)
        if isnan is None or isnan.op.fn != "isnan" or isnan.inputs[0] != x or self._scalar(zero) != 0.0:
            return p
        if len(self.consumers.get(x, [])) != 2 or x in self.outputs:
            return p
        zb = self.node(zero, Broadcast)
        for n in (w, isnan) + ((zb,) if zb is not None else ()):
            self.take(n)
        self.nan_to_zero = True
        return x

    def _softmax(self, mul: BasicNode) -> str | None:
        """mul(e, broadcast(reciprocal(sum(e)))) with e = exp(x - broadcast(max(x))) over the
        last axis: x, or None."""
        e, b = mul.inputs
        e_node = self.node(e, Elementwise, uses=2)
        if e_node is None:
            e, b = b, e
            e_node = self.node(e, Elementwise, uses=2)
        if e_node is None or e_node.op.fn != "exp":
            return None
        rank = len(self.g.tensors[e].shape)
        bn = self.node(b, Broadcast)
        rn = bn and self.node(bn.inputs[0], Elementwise)
        sn = rn and rn.op.fn == "reciprocal" and self.node(rn.inputs[0], Reduce)
        if not sn or sn.op.fn != "sum" or not _last_axis(sn.op, rank) or sn.inputs[0] != e:
            return None
        dn = self.node(e_node.inputs[0], Elementwise)
        if dn is None or dn.op.fn != "sub":
            return None
        x, bm = dn.inputs
        mb = self.node(bm, Broadcast)
        mn = mb and self.node(mb.inputs[0], Reduce)
        if not mn or mn.op.fn != "max" or not _last_axis(mn.op, rank) or mn.inputs[0] != x:
            return None
        if len(self.consumers.get(x, [])) != 2 or x in self.outputs:
            return None
        for n in (bn, rn, sn, e_node, dn, mb, mn):
            self.take(n)
        return x

    def _bias_options(self, x: str, uses: int = 1):
        """(bias or None, the scores' tensor, the nodes the bias add takes) for each reading of x
        (read `uses` times inside the pattern): scores + bias with either operand as the scores,
        and x as the scores itself."""
        n = self.node(x, Elementwise, uses=uses)
        if n is not None and n.op.fn == "add":
            for scores, b in (n.inputs, n.inputs[::-1]):
                bn = self.node(b, Broadcast)
                bias = bn.inputs[0] if bn is not None else b
                if self.g.tensors[bias].dtype == self.g.tensors[scores].dtype:
                    yield bias, scores, [n] + ([bn] if bn is not None else [])
        yield None, x, []

    def _scale(self, x: str, uses: int = 1) -> tuple[float, str, list]:
        """(scale, the unscaled scores, the nodes taken): x = s * c or s / c, c a scalar constant
        (x read `uses` times inside the pattern: twice where an fp32 softmax reads it directly)."""
        n = self.node(x, Elementwise, uses=uses)
        if n is None or n.op.fn not in ("mul", "div"):
            return 1.0, x, []
        for s, c in ((n.inputs, n.inputs[::-1]) if n.op.fn == "mul" else (n.inputs,)):
            value = self._scalar(c)
            if value is None or value == 0.0:
                continue
            bn = self.node(c, Broadcast)
            return (value if n.op.fn == "mul" else 1.0 / value), s, [n] + ([bn] if bn is not None else [])
        return 1.0, x, []

    def _scalar(self, t: str) -> float | None:
        return _constant_scalar(self.g, self.producer, t)

    def _shapes_ok(self, q: str, k: str, v: str, y: str, bias: str | None) -> bool:
        t = self.g.tensors
        if bias is not None:
            try:
                if np.broadcast_shapes(t[bias].shape, t[y].shape[:-1] + (t[k].shape[-2],)) != \
                        t[y].shape[:-1] + (t[k].shape[-2],):
                    return False
            except ValueError:
                return False
        sq, sk, sv = t[q].shape, t[k].shape, t[v].shape
        if len(sq) < 3 or not len(sq) == len(sk) == len(sv) or not sq[:-2] == sk[:-2] == sv[:-2]:
            return False
        if sk[-1] != sq[-1] or sv[-2] != sk[-2]:
            return False
        dtypes = {np.dtype(t[n].dtype).name for n in (q, k, v, y)}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        if dtype in LOW_PRECISION:
            return all(d % 8 == 0 and d <= MAX_HEAD for d in (sq[-1], sv[-1]))
        # float32: only the decode kernel's shapes (backends/cuda/decode_attention.py)
        return dtype == "float32" and bias is None and not self.nan_to_zero and sq[-2] <= MAX_DECODE_ROWS \
            and sk == sv and sq[-1] in DECODE_HEADS


def _last_axis(op: Reduce, rank: int) -> bool:
    return op.keepdims and tuple(a % rank for a in op.axes) == (rank - 1,)


def _replace(graph: BasicGraph, pv: BasicNode, q, k, v, bias, scale, nan_to_zero, chain) -> None:
    stored, in_perms, in_views = [], [], []
    # float32 (decode) operands are read as they are: the decode kernel reads no transposes or views
    split = np.dtype(graph.tensors[q].dtype).name != "float32"
    for t, scaled in ((q, True), (k, True), (v, False)):
        t, perm, view, factor, taken = _head_split(graph, t, scaled) if split else (t, (), (), 1.0, [])
        stored.append(t)
        in_perms.append(perm)
        in_views.append(view)
        scale *= factor
        chain = chain + taken
    inputs = tuple(stored) + ((bias,) if bias is not None else ())
    outputs, perm, shape = pv.outputs, (), ()
    merge = _head_merge(graph, pv)
    if merge:   # the head merge (a transpose and / or reshapes of it) is written by the op itself
        chain = chain + merge
        outputs = merge[-1].outputs
        perm = tuple(merge[0].op.perm) if isinstance(merge[0].op, Transpose) else ()
        if isinstance(merge[-1].op, Reshape):
            shape = tuple(merge[-1].op.shape)
    op = Attention(float(scale), nan_to_zero, perm, shape, tuple(in_perms) if any(in_perms) else (),
                   tuple(in_views) if any(in_views) else ())
    fused = BasicNode(pv.name, op, inputs, outputs, pv.origin)
    gone = {id(n) for n in chain}
    for n in chain + [pv]:
        for t in n.outputs:
            if t not in outputs:
                graph.tensors.pop(t, None)
    graph.nodes = [fused if n is pv else n for n in graph.nodes if id(n) not in gone]


def _head_split(graph: BasicGraph, t: str, scaled: bool):
    """An operand made from a stored tensor by moves alone -- (Q and K) a multiply by a scalar
    constant, then Reshapes, Transposes and Slices, each the only reader of what it reads -- is
    read from that tensor: (the tensor to read, the rank-4 permutation that makes the operand of it
    (its leading dims padded with 1s) or (), the strided view that makes it (offset, shape,
    strides) where no permutation does or (), the scalar to fold into the scale, the nodes taken);
    (t, (), (), 1.0, []) where there is none. A view keeps the head size contiguous (cuDNN's
    operands have unit stride there): one third of a fused QKV projection, heads split, is one."""
    producer, consumers = graph.producer(), graph.consumers()
    outputs = {x.name for x in graph.outputs}

    def sole(x, kind):
        n = producer.get(x)
        ok = n is not None and isinstance(n.op, kind) and x not in outputs and len(consumers.get(x, [])) == 1
        return n if ok else None
    taken, factor, cur = [], 1.0, t
    m = sole(cur, Elementwise) if scaled else None
    if m is not None and m.op.fn == "mul":
        for x, c in (m.inputs, m.inputs[::-1]):
            value = _constant_scalar(graph, producer, c)
            if value:   # a zero scale is left as it is
                taken.append(m)
                bn = sole(c, Broadcast)
                if bn is not None:
                    taken.append(bn)
                factor, cur = value, x
                break
    moves = []
    while (n := sole(cur, (Reshape, Transpose, Slice))) is not None:
        moves.append(n)
        cur = n.inputs[0]
    rank = len(graph.tensors[t].shape)
    if rank != 4:
        return t, (), (), 1.0, []
    perm = _split_perm(graph, moves)
    if perm is not None:
        return moves[-1].inputs[0], perm, (), factor, taken + moves
    while moves:   # the longest chain of moves that is a view of what it reads
        view = _compose_view(graph, moves[::-1])
        if view is not None and view[2][-1] == 1:
            return moves[-1].inputs[0], (), view, factor, taken + moves
        moves.pop()
    return t, (), (), 1.0, []


def _split_perm(graph: BasicGraph, moves: list[BasicNode]) -> tuple[int, ...] | None:
    """The permutation of a head split (Reshapes that only add or drop leading 1s after one
    Transpose keeping the last axis), `moves` listed from the operand back; None otherwise."""
    if not moves or not isinstance(moves[-1].op, Transpose):
        return None
    if not all(isinstance(r.op, Reshape) and _drops_leading_ones(graph, r) for r in moves[:-1]):
        return None
    tr = moves[-1]
    lead = 4 - len(tr.op.perm)
    if tr.op.perm[-1] != len(tr.op.perm) - 1 or lead < 0:
        return None
    return tuple(range(lead)) + tuple(a + lead for a in tr.op.perm)


def _compose_view(graph: BasicGraph, moves: list[BasicNode]):
    """(offset, shape, strides) in elements of the first move's input, contiguous, that the moves
    (in order) make of it, or None where one of them copies (a Reshape no view can express, a
    reversed Slice)."""
    shape = tuple(int(d) for d in graph.tensors[moves[0].inputs[0]].shape)
    strides, offset = _row_major(shape), 0
    for n in moves:
        op = n.op
        if isinstance(op, Transpose):
            shape, strides = tuple(shape[a] for a in op.perm), tuple(strides[a] for a in op.perm)
        elif isinstance(op, Slice):
            if any(st <= 0 for st in op.steps) or any(e is None for e in op.stops):
                return None
            offset += sum(b * s for b, s in zip(op.starts, strides))
            shape = tuple(len(range(b, e, st)) for b, e, st in zip(op.starts, op.stops, op.steps))
            strides = tuple(s * st for s, st in zip(strides, op.steps))
        else:
            new = tuple(int(d) for d in graph.tensors[n.outputs[0]].shape)
            strides = view_reshape(shape, strides, new)
            if strides is None:
                return None
            shape = new
    return int(offset), shape, tuple(int(s) for s in strides)


def _row_major(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def view_reshape(shape, strides, new) -> tuple[int, ...] | None:
    """Strides that make `new` a view of the strided tensor (shape, strides) in row-major element
    order, or None where the reshape must copy (numpy's rule: each group of old axes merged or
    split must be contiguous within itself)."""
    if int(np.prod(shape, dtype=np.int64)) != int(np.prod(new, dtype=np.int64)):
        return None
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    out = [0] * len(new)
    ni = oi = 0
    while ni < len(new) or oi < len(old):
        if ni < len(new) and new[ni] == 1:
            out[ni] = 1
            ni += 1
            continue
        if ni == len(new) or oi == len(old):
            return None
        nj, oj, np_, op_ = ni + 1, oi + 1, new[ni], old[oi][0]
        while np_ != op_:   # grow the smaller side until both groups hold the same elements
            if np_ < op_:
                np_ *= new[nj]
                nj += 1
            else:
                op_ *= old[oj][0]
                oj += 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(oi, oj - 1)):
            return None
        out[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            out[k - 1] = out[k] * new[k]
        ni, oi = nj, oj
    return tuple(out)


def _constant_scalar(graph: BasicGraph, producer, t: str) -> float | None:
    """The value of `t` where it is a one-element constant or a Broadcast of one, else None."""
    n = producer.get(t)
    src = n.inputs[0] if n is not None and isinstance(n.op, Broadcast) else t
    c = graph.constants.get(src)
    if c is None or np.size(c) != 1:
        return None
    return float(np.asarray(c, np.float64).reshape(()))


def _drops_leading_ones(graph: BasicGraph, r: BasicNode) -> bool:
    """A Reshape whose input and output differ only by leading extent-1 axes."""
    a, b = graph.tensors[r.inputs[0]].shape, graph.tensors[r.outputs[0]].shape
    strip = lambda s: tuple(s[next((i for i, d in enumerate(s) if d != 1), len(s)):])
    return strip(a) == strip(b)


def _head_merge(graph: BasicGraph, pv: BasicNode) -> list[BasicNode]:
    """[the Transpose that alone reads the attention's rank-4 result keeping the head size last
    (heads merged back: [B, H, S, D] -> [B, S, H, D]), if any, then the chain of Reshapes that
    each alone read the one before], or []: all only relabel what the op can write directly."""
    consumers, outputs = graph.consumers(), {t.name for t in graph.outputs}

    def only_user(t, kind):
        users = consumers.get(t, [])
        if len(users) != 1 or t in outputs or not isinstance(users[0].op, kind):
            return None
        return users[0]
    y = pv.outputs[0]
    t = only_user(y, Transpose) if len(graph.tensors[y].shape) == 4 else None
    if t is not None and t.op.perm[-1] != 3:
        return []
    taken = [t] if t is not None else []
    # reshapes after it (or of the result itself: the importer writes a transpose that only
    # moves an extent-1 axis, as a decode step's head merge does, as a reshape)
    while (r := only_user(taken[-1].outputs[0] if taken else y, Reshape)) is not None:
        taken.append(r)
    return taken
