"""Parallel GEMMs as one: a basic-graph rewrite that merges MatMuls reading the same activation
with constant weights into one MatMul over the weights side by side, each original result a
slice of the merged one.

Why: a transformer layer multiplies one activation by several weights -- LLaMA's q, k and v
projections (1024 -> 1024, 256, 256) and its gate and up projections (1024 -> 2816 twice),
BERT's query, key and value. At batch 1 each product is a small GEMM that leaves most SMs idle
and pays a launch of its own; side by side they are one GEMM with a wider N (one launch, a grid
that fills the device, the activation read once). The slices are moves: the memory-bound kernels
that read the results read them from the merged tensor, and the fused attention reads its
operands through strides (frontend/attention.py), so no copy is made.

Biases: where every member's only reader adds a constant vector over the last axis (BERT's
Linear layers), the vectors are concatenated too and added to the merged result, so the bias add
can still move into the GEMM (frontend/gemm_bias.py).

Typed GEMMs (TypedMatMul from MatMulNBits / MatMulLowBit: low-bit weights) merge the same way
where they share the activation, the weight type, K, the block size and attributes: each
constant (packed codes, scales, zero points, bias) is stored output column by output column, so
the merged constants are the members' side by side along N. Measured on the H200 at M = 1
(benchmarks/results/ttile-prefill.md): LLaMA-7B's q, k, v as three int4 GEMVs 3 x 5.5 us, as one
(12288 x 4096) 10.4 us; gate and up as one (22016 x 4096) 16.6 us.

Only for CUDA targets (pipeline/driver.py), only MatMuls the partition would make library calls,
run before the attention matcher. Values: each output element is the same dot product as before.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from powerfusion.basic import (
    BasicGraph,
    BasicNode,
    Broadcast,
    Elementwise,
    MatMul,
    Slice,
    TypedMatMul,
)
from powerfusion.frontend.gemm_bias import (
    constant_vector,
    drop_unread_broadcasts,
    new_constant,
    new_tensor,
)
from powerfusion.frontend.partition import is_library


def merge_parallel_matmuls(graph: BasicGraph, target: str = "cuda") -> int:
    """Rewrite `graph` in place; returns how many MatMuls were merged away (members less groups)."""
    groups: dict[tuple, list[BasicNode]] = defaultdict(list)
    for node in graph.nodes:
        key = _group_key(graph, node, target)
        if key is not None:
            groups[key].append(node)
    merged = 0
    for members in groups.values():
        if len(members) > 1:
            (_merge_typed if isinstance(members[0].op, TypedMatMul) else _merge)(graph, members)
            merged += len(members) - 1
    return merged


def _group_key(graph: BasicGraph, node: BasicNode, target: str):
    op = node.op
    if isinstance(op, TypedMatMul):
        return _typed_key(graph, node)
    if not isinstance(op, MatMul) or op.trans_a or op.bias or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    w = graph.constants.get(b)
    if w is None or np.ndim(w) != 2 or not is_library(graph, node, target):
        return None
    k = w.shape[1] if op.trans_b else w.shape[0]
    return a, op.trans_b, int(k), np.dtype(w.dtype).name, np.dtype(graph.tensors[node.outputs[0]].dtype).name


def _merge(graph: BasicGraph, members: list[BasicNode]) -> None:
    trans_b = members[0].op.trans_b
    axis = 0 if trans_b else 1
    weights = [np.asarray(graph.constants[m.inputs[1]]) for m in members]
    widths = [int(w.shape[axis]) for w in weights]
    first = graph.tensors[members[0].outputs[0]]
    lead, dtype = tuple(int(d) for d in first.shape[:-1]), first.dtype
    base = members[0].outputs[0]
    w = new_constant(graph, f"{base}_weights", np.asarray(np.concatenate(weights, axis=axis), order="C"))
    y = new_tensor(graph, f"{base}_merged", lead + (sum(widths),), dtype)
    new = [BasicNode(members[0].name, MatMul(trans_b=trans_b), (members[0].inputs[0], w), (y,), members[0].origin)]
    biases = _bias_adds(graph, members)
    if biases is not None:
        vector = new_constant(graph, f"{base}_bias", np.concatenate([v for _, v in biases]))
        wide = new_tensor(graph, f"{base}_bias_wide", lead + (sum(widths),), dtype)
        summed = new_tensor(graph, f"{base}_biased", lead + (sum(widths),), dtype)
        new += [BasicNode(f"{members[0].name}_bias", Broadcast(lead + (sum(widths),)), (vector,), (wide,),
                          members[0].origin),
                BasicNode(f"{members[0].name}_add", Elementwise("add"), (y, wide), (summed,), members[0].origin)]
        y = summed
    outputs = [add.outputs[0] for add, _ in biases] if biases is not None else [m.outputs[0] for m in members]
    gone = {id(add) for add, _ in biases} if biases is not None else set()
    if biases is not None:
        for m in members:
            graph.tensors.pop(m.outputs[0], None)
    _replace(graph, members, new, y, widths, outputs, gone)


def _replace(graph: BasicGraph, members: list[BasicNode], new: list[BasicNode], y: str, widths: list[int],
             outputs: list[str], gone: set[int]) -> None:
    """Put `new` (the merged product, writing y) where the first member was, each member's
    result (outputs) a Slice of y along the last axis; drop the members and the nodes in `gone`."""
    lead = tuple(int(d) for d in graph.tensors[y].shape[:-1])
    offset = 0
    for m, n, out in zip(members, widths, outputs):
        starts = (0,) * len(lead) + (offset,)
        stops = lead + (offset + n,)
        new.append(BasicNode(f"{m.name}_part", Slice(starts, stops, (1,) * (len(lead) + 1)), (y,), (out,), m.origin))
        offset += n
    gone = gone | {id(m) for m in members}
    at = graph.nodes.index(members[0])
    rest = [n for n in graph.nodes if id(n) not in gone]
    at = sum(1 for n in graph.nodes[:at] if id(n) not in gone)
    graph.nodes = rest[:at] + new + rest[at:]
    drop_unread_broadcasts(graph)


def _bias_adds(graph: BasicGraph, members: list[BasicNode]):
    """[(the add, its bias vector)] per member where each member's only reader adds a constant
    vector over the last axis; None where any does not."""
    consumers = graph.consumers()
    outputs = {t.name for t in graph.outputs}
    found = []
    for m in members:
        y = m.outputs[0]
        users = consumers.get(y, [])
        if y in outputs or len(users) != 1:
            return None
        add = users[0]
        if not isinstance(add.op, Elementwise) or add.op.fn != "add" or len(add.inputs) != 2:
            return None
        other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
        vector = constant_vector(graph, other, int(graph.tensors[y].shape[-1]))
        if vector is None or vector[1].dtype != np.dtype(graph.tensors[y].dtype):
            return None
        found.append((add, vector[1]))
    return found


# ---- typed GEMMs ------------------------------------------------------------------------
def _typed_key(graph: BasicGraph, node: BasicNode):
    """Typed GEMMs merge where everything but N agrees; DequantizeLinear weights ([K, N], stored
    K-major) are left alone."""
    op = node.op
    consts = node.inputs[1:]
    if op.source not in ("MatMulNBits", "MatMulLowBit") or any(c not in graph.constants for c in consts):
        return None
    attrs = tuple((k, v) for k, v in op.attrs if k != "N")
    kinds = tuple((np.dtype(graph.constants[c].dtype).name, np.size(graph.constants[c]) % op.N) for c in consts)
    if any(rest for _, rest in kinds):
        return None
    return ("typed", node.inputs[0], op.source, op.bits, op.block_size, op.K, attrs, op.slots, kinds,
            np.dtype(graph.tensors[node.outputs[0]].dtype).name)


def _merge_typed(graph: BasicGraph, members: list[BasicNode]) -> None:
    """One TypedMatMul over the members' constants side by side along N (each stored N-major)."""
    first = members[0]
    widths = [int(m.op.N) for m in members]
    consts = []
    for slot in range(1, len(first.inputs)):
        parts = [np.asarray(graph.constants[m.inputs[slot]]) for m in members]
        side = np.concatenate([p.reshape(n, -1) for p, n in zip(parts, widths)], axis=0)
        shape = (-1,) if parts[0].ndim == 1 else (sum(widths),) + parts[0].shape[1:]
        consts.append(new_constant(graph, f"{first.outputs[0]}_c{slot}", np.ascontiguousarray(side.reshape(shape))))
    info = graph.tensors[first.outputs[0]]
    y = new_tensor(graph, f"{first.outputs[0]}_merged", tuple(info.shape[:-1]) + (sum(widths),), info.dtype)
    attrs = tuple((k, sum(widths) if k == "N" else v) for k, v in first.op.attrs)
    op = dataclasses.replace(first.op, N=sum(widths), attrs=attrs)
    new = [BasicNode(first.name, op, (first.inputs[0], *consts), (y,), first.origin)]
    _replace(graph, members, new, y, widths, [m.outputs[0] for m in members], set())
