"""A decode step's KV append read in place: Attention over Concat(cache, new rows) becomes an
Attention that reads the cache and the new rows where they lie (basic.Attention.kv_tail).

Why: an exported decode step (Hugging Face's, ours in benchmarks/decode_llm_model.py) computes
keys = Concat(past_key, new_key) along the rows and attends over them. Materialised, the Concat
reads and writes the whole cache once more per layer than the attention itself does: at LLaMA-7B
widths and a 1K cache 16 MB of the 24 MB a layer's attention moves at batch 1 (256 MB at batch 16).
The split-KV decode kernel (backends/cuda/decode_attention.py) reads the rows past the cache
from a second pointer instead, so no copy is made.

Only where the decode kernel takes the attention (at most MAX_DECODE_ROWS query rows, a head
size in DECODE_HEADS, no bias, NaN guard, transposed or strided operand: a view that reads its
tensor whole in memory order is none), both Concats join two
tensors along the row axis with the same split, and each Concat's result is read by the
attention alone. Only for CUDA targets (pipeline/driver.py), after frontend/attention.py.
"""
from __future__ import annotations

import dataclasses

from powerfusion.basic import Attention, BasicGraph, BasicNode, Concat, plain_view
from powerfusion.frontend.attention import DECODE_HEADS, MAX_DECODE_ROWS


def fold_kv_append(graph: BasicGraph) -> int:
    """Rewrite `graph` in place; returns how many attentions now read appended rows in place."""
    count = 0
    for name in [n.name for n in graph.nodes if isinstance(n.op, Attention)]:
        att = next(n for n in graph.nodes if n.name == name)
        pair = _appends(graph, att)
        if pair is None:
            continue
        (kc, vc), tail = pair
        op = dataclasses.replace(att.op, kv_tail=tail)
        ins = (att.inputs[0], kc.inputs[0], vc.inputs[0], kc.inputs[1], vc.inputs[1])
        fused = BasicNode(att.name, op, ins, att.outputs, att.origin)
        graph.nodes = [fused if n is att else n for n in graph.nodes if n is not kc and n is not vc]
        for t in (kc.outputs[0], vc.outputs[0]):
            graph.tensors.pop(t, None)
        count += 1
    return count


def _appends(graph: BasicGraph, att: BasicNode):
    """((the K Concat, the V Concat), rows appended) where the attention can read them in place."""
    op, t = att.op, graph.tensors
    if op.kv_tail or len(att.inputs) != 3 or op.nan_to_zero or any(op.in_perms) or \
            not all(plain_view(v, t[n].shape) for v, n in zip(op.in_views, att.inputs)):
        return None
    q = op.in_views[0][1] if op.in_views and op.in_views[0] else t[att.inputs[0]].shape
    if q[-2] > MAX_DECODE_ROWS or q[-1] not in DECODE_HEADS:
        return None
    producer, consumers = graph.producer(), graph.consumers()
    outputs = {x.name for x in graph.outputs}
    concats = []
    if op.in_views and any(op.in_views[1:]):
        return None   # K and V must be the Concats' results as stored
    for name in att.inputs[1:3]:
        c = producer.get(name)
        if c is None or not isinstance(c.op, Concat) or len(c.inputs) != 2 or name in outputs \
                or any(u is not att for u in consumers.get(name, [])):
            return None
        if c.op.axis != len(t[name].shape) - 2:
            return None
        concats.append(c)
    (kc, vc) = concats
    shapes = [tuple(t[x].shape) for x in (*kc.inputs, *vc.inputs)]
    if shapes[0] != shapes[2] or shapes[1] != shapes[3] or shapes[0][:-2] != shapes[1][:-2]:
        return None
    return (kc, vc), int(shapes[1][-2])
