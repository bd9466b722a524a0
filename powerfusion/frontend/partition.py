"""Partition a basic graph by cost: library calls for compute-bound MatMul/Conv,
maximal acyclic subgraphs of everything else.

An op is compute-bound when its arithmetic intensity (FLOPs over compulsory bytes:
inputs read once, output written once) exceeds the target's ridge point for its
dtype; only MatMul and Conv can be. A GEMV (M = 1) or a depthwise conv falls
below and stays with the memory-bound ops. TypedMatMul (a low-bit weight) is
always a library call: the typed GEMM kernels are its only runner.

Grouping: each memory-bound op gets a level = the largest number of library calls
on a path from the graph inputs to it. Connected memory-bound ops of one level form
a group; no path between two ops of one level can pass through a library call, so
the contracted graph is acyclic. Neighbouring groups are then merged greedily
while the contracted graph stays acyclic, which makes the groups maximal.

Horizontal fusion: memory-bound groups of one level that no path connects either way (an
RMSNorm beside a SwiGLU; the reshapes after three projections) are merged too, so they share
one subgraph and the lowering can give them one launch (each part keeps its own tiling; units
beyond a part's extent are guarded off). Contracting two unconnected nodes cannot make a
cycle. A merged group stays below HFUSE_MAX_NODES nodes, which bounds the plan search.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from powerfusion.basic import (LIBRARY_OPS, BasicGraph, BasicNode, Conv, Elementwise, LibraryCall, MatMul,
                               OnnxFallback, Partition, Reduce, Subgraph, TypedMatMul, Attention)
from powerfusion.frontend.quantized import packed_bytes
from powerfusion.targets.specs import get_target
from powerfusion.scalar import scalar_fn


def node_flops(graph: BasicGraph, node: BasicNode) -> int:
    out = graph.tensors[node.outputs[0]]
    op = node.op
    if isinstance(op, Elementwise):
        return out.size * scalar_fn(op.fn).flops
    if isinstance(op, Reduce):
        return graph.tensors[node.inputs[0]].size
    if isinstance(op, MatMul):
        a = graph.tensors[node.inputs[0]].shape
        k = a[-2] if op.trans_a else a[-1]
        return 2 * out.size * k
    if isinstance(op, TypedMatMul):
        return 2 * out.size * op.K
    if isinstance(op, Attention):   # two products over the keys
        q, k = graph.tensors[node.inputs[0]].shape, graph.tensors[node.inputs[1]].shape
        return 2 * int(np.prod(q[:-1], dtype=np.int64)) * k[-2] * (q[-1] + out.shape[-1])
    if isinstance(op, Conv):
        w = graph.tensors[node.inputs[1]].shape
        per_output = int(np.prod(w[1:], dtype=np.int64))  # C/group x kernel
        return 2 * out.size * per_output + (out.size if len(node.inputs) > 2 else 0)
    return 0


def node_bytes(graph: BasicGraph, node: BasicNode) -> int:
    if isinstance(node.op, TypedMatMul):  # the weight at its packed width, not one byte per int4
        return packed_bytes(graph, node)
    return sum(graph.tensors[t].nbytes for t in set(node.inputs)) + sum(graph.tensors[t].nbytes for t in node.outputs)


GEMV_MAX_ROWS = 8  # a MatMul with at most this many rows per product is GEMV-like (GIR templates)
# On GPUs a GEMV-like MatMul over a constant weight at least this large is the library's: GIR's
# GEMV template streams such a weight at 0.25-0.35 of cuBLAS's speed (LLaMA-7B widths, fp16, M = 1,
# H200: 115-127 us where cuBLAS takes 27-43 us; benchmarks/results/decode-llm.md), and beside a
# weight this size the DRAM round trip of a fused neighbour costs little. Smaller weights (the
# classifier heads of the CNN zoo, 1-5 MB) stay GIR's, fused with their neighbours.
GPU_LIBRARY_GEMV_BYTES = 8 << 20


def has_gir_template(graph: BasicGraph, node: BasicNode, target: str = "cpu") -> bool:
    """Memory-bound library ops that GIR can express: GEMV-like MatMuls (few rows, as in
    decode attention) and depthwise convolutions (on GPUs). Any other MatMul/Conv stays a
    library call even below the ridge point, since GIR has no tiled-GEMM template to run it.

    On the CPU a depthwise conv is a library call: the generated C of the GIR template
    computes one output a unit with a guarded, index-dividing gather per tap, while the
    CPU driver's direct conv accumulates tap by tap along an output row (vectorised).
    EfficientNet-B0's 240-channel 28x28 5x5 block (conv + BN + SiLU + pool): 30 ms as GIR."""
    op = node.op
    if isinstance(op, MatMul):
        if op.bias:   # a GEMM epilogue (frontend/gemm_bias.py): the library's
            return False
        a = graph.tensors[node.inputs[0]].shape
        b = graph.tensors[node.inputs[1]].shape
        rows = 1 if len(a) < 2 else (a[-1] if op.trans_a else a[-2])
        if len(b) <= 2 and not op.trans_a:
            # B shared by every product: the batch folds into the rows of one GEMM, e.g. a
            # channels-last linear (1, 7, 7, 768) x (768, 3072) is 49 x 768 x 3072, not 7 GEMVs
            rows = int(np.prod([int(d) for d in a[:-1]], dtype=np.int64)) if len(a) >= 2 else 1
        if rows > GEMV_MAX_ROWS:
            return False
        weight = node.inputs[1]
        return not (get_target(target).backend != "cpu" and weight in graph.constants
                    and graph.tensors[weight].nbytes >= GPU_LIBRARY_GEMV_BYTES)
    if isinstance(op, Conv):
        if get_target(target).backend == "cpu":
            return False
        x, w = graph.tensors[node.inputs[0]].shape, graph.tensors[node.inputs[1]].shape
        # channels-last (frontend/layout.py): x [N, *I, C], w [Cout, *K, 1]; the depthwise ones
        # run as conv.depthwise.cols with lanes along C, the rest are the library's
        c, per_group = (x[-1], w[-1]) if op.channels_last else (x[1], w[1])
        return op.group > 1 and op.group == c and w[0] == op.group and per_group == 1  # one input channel per group
    return False


def is_library(graph: BasicGraph, node: BasicNode, target: str) -> bool:
    if not isinstance(node.op, LIBRARY_OPS):
        return False
    if isinstance(node.op, (TypedMatMul, Attention, OnnxFallback)):  # only a typed GEMM runs a low-bit
        return True        # weight, only cuDNN (or its stand-in) fused attention, only onnxruntime a fallback
    dtype = np.dtype(graph.tensors[node.inputs[0]].dtype).name
    intensity = node_flops(graph, node) / max(node_bytes(graph, node), 1)
    return intensity > get_target(target).ridge_point(dtype) or not has_gir_template(graph, node, target)


def partition_graph(graph: BasicGraph, target: str = "cpu") -> Partition:
    nodes = graph.nodes
    producer = {t: i for i, n in enumerate(nodes) for t in n.outputs}
    preds = [{producer[t] for t in n.inputs if t in producer} for n in nodes]
    lib = [is_library(graph, n, target) for n in nodes]

    # level: library calls on the longest path from the inputs (nodes are topologically ordered)
    level = [0] * len(nodes)
    for i in range(len(nodes)):
        base = max((level[p] for p in preds[i]), default=0)
        level[i] = base + 1 if lib[i] else base

    group = _initial_groups(nodes, preds, lib, level)
    group = _merge_groups(preds, group, lib)
    group = _merge_independent(preds, group, lib, level)

    steps = _order_steps(graph, nodes, preds, lib, group)
    return Partition(graph=graph, target=target, steps=steps)


def _initial_groups(nodes, preds, lib, level) -> list[int]:
    uf = list(range(len(nodes)))

    def find(i):
        while uf[i] != i:
            uf[i] = uf[uf[i]]
            i = uf[i]
        return i

    for i in range(len(nodes)):
        if lib[i]:
            continue
        for p in preds[i]:
            if not lib[p] and level[p] == level[i]:
                uf[find(p)] = find(i)
    return [find(i) for i in range(len(nodes))]


def _merge_groups(preds, group, lib) -> list[int]:
    """Merge adjacent memory-bound groups while the contracted graph stays acyclic:
    u -> v may merge when v is reachable from u by that edge only."""
    is_lib = {group[i]: lib[i] for i in range(len(group))}
    q = _quotient(preds, group)
    into: dict[int, int] = {}
    changed = True
    while changed:
        changed = False
        for u, v in list(q.edges):
            if is_lib[u] or is_lib[v] or not (q.has_node(u) and q.has_node(v) and q.has_edge(u, v)):
                continue
            if any(nx.has_path(q, s, v) for s in q.successors(u) if s != v):
                continue
            nx.contracted_nodes(q, u, v, self_loops=False, copy=False)
            into[v] = u
            changed = True

    def root(g):
        while g in into:
            g = into[g]
        return g
    return [root(g) for g in group]


HFUSE_MAX_NODES = 48


def _merge_independent(preds, group, lib, level) -> list[int]:
    """Merge memory-bound groups of one level that are unconnected in the contracted graph."""
    q = _quotient(preds, group)
    size: dict[int, int] = {}
    first: dict[int, int] = {}
    lvl: dict[int, int] = {}
    for i, g in enumerate(group):
        size[g] = size.get(g, 0) + 1
        first.setdefault(g, i)
        lvl[g] = max(lvl.get(g, 0), level[i])
    into: dict[int, int] = {}
    mem = sorted((g for g in size if not lib[first[g]]), key=first.get)
    for k, a in enumerate(mem):
        if a in into:
            continue
        for b in mem[k + 1:]:
            if b in into or lvl[b] != lvl[a] or size[a] + size[b] > HFUSE_MAX_NODES:
                continue
            if nx.has_path(q, a, b) or nx.has_path(q, b, a):
                continue
            nx.contracted_nodes(q, a, b, self_loops=False, copy=False)
            into[b], size[a] = a, size[a] + size[b]
    return [into.get(g, g) for g in group]


def _quotient(preds, group) -> nx.DiGraph:
    q = nx.DiGraph()
    q.add_nodes_from(set(group))
    for i, ps in enumerate(preds):
        for p in ps:
            if group[p] != group[i]:
                q.add_edge(group[p], group[i])
    return q


def _order_steps(graph, nodes, preds, lib, group):
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)
    q = _quotient(preds, group)
    consumers = graph.consumers()
    graph_outputs = {t.name for t in graph.outputs}
    steps, sg_count = [], 0
    order = nx.lexicographical_topological_sort(q, key=lambda g: min(members[g]))
    for g in order:
        idx = members[g]
        if lib[idx[0]]:
            n = nodes[idx[0]]
            steps.append(LibraryCall(n, node_flops(graph, n), node_bytes(graph, n)))
            continue
        sub = [nodes[i] for i in idx]
        steps.append(_subgraph(graph, f"sg{sg_count}", sub, consumers, graph_outputs))
        sg_count += 1
    return steps


def _subgraph(graph, name, sub, consumers, graph_outputs) -> Subgraph:
    inside = {id(n) for n in sub}
    produced = [t for n in sub for t in n.outputs]
    produced_set = set(produced)
    inputs = list(dict.fromkeys(t for n in sub for t in n.inputs if t not in produced_set))
    outputs = [t for t in produced
               if t in graph_outputs or any(id(c) not in inside for c in consumers.get(t, []))]
    flops = sum(node_flops(graph, n) for n in sub)
    nbytes = sum(graph.tensors[t].nbytes for t in inputs) + sum(graph.tensors[t].nbytes for t in outputs)
    return Subgraph(name, tuple(sub), tuple(inputs), tuple(outputs), flops, nbytes)
