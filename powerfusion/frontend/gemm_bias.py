"""GEMM bias epilogues: a basic-graph rewrite that moves a bias add into the MatMul before it,
where that add would otherwise be the only arithmetic of a memory-bound kernel.

Why: a transformer's fused QKV projection is Gemm(x, W, b) and then a split into Q, K and V.
Decomposed, the bias add and the split make a memory-bound kernel of their own between the GEMM
and the attention (GPT-2 fp16 on the H200: 5.3 us a layer, 64 us of a 594 us run), where
torch.compile adds the bias in cuBLASLt's epilogue and hands the attention strided views. With
the add in the GEMM (`MatMul(bias=True)`, run by cuBLASLt's BIAS epilogue, backends/cuda/blaslt.py)
the split is a view the fused attention reads through strides (frontend/attention.py), and no
kernel is left.

What is matched: y = MatMul(A, B) whose only reader is z = y + c (either operand order), c a
constant vector over y's last axis (stored as [N] or [1, ..., N], or a Broadcast of one), and
z read by nothing that computes: only by moves (Reshape, Transpose, Slice) that end in library
calls or graph outputs; or z read only by Transposes that move its last axis (ConvNeXt's Linear
then `permute(0, 3, 1, 2)` back to NCHW): there the reader walks z across the bias axis, and
the search kept the add as a kernel of its own in every block (ConvNeXt-T fp16, batch 1: 18
bias-only kernels of 1.3-7 us). Where z feeds elementwise work in its own layout, the add costs
nothing in that kernel and is left there (cuBLAS's plain GEMMs are a little faster than its
bias epilogue: 0.35 us a call on GPT-2's projections). Only run for CUDA targets (pipeline/driver.py), only on MatMuls the
partition would make library calls (a GEMV-like one stays GIR's, frontend/partition.py).
"""
from __future__ import annotations

import numpy as np

from powerfusion.basic import (
    LIBRARY_OPS,
    BasicGraph,
    BasicNode,
    Broadcast,
    Elementwise,
    MatMul,
    Reshape,
    Slice,
    TensorInfo,
    Transpose,
)
from powerfusion.frontend.partition import is_library
from powerfusion.names import fresh_name

DTYPES = ("float16", "bfloat16", "float32")
_MOVES = (Reshape, Transpose, Slice)


def fold_gemm_bias(graph: BasicGraph, target: str = "cuda") -> int:
    """Rewrite `graph` in place; returns how many bias adds moved into their MatMul."""
    count = 0
    for mm in list(graph.nodes):
        if not isinstance(mm.op, MatMul) or mm.op.bias or not is_library(graph, mm, target):
            continue
        found = _bias_add(graph, mm)
        if found is not None:
            _fold(graph, mm, *found)
            count += 1
    return count


def _bias_add(graph: BasicGraph, mm: BasicNode):
    """(the add node, its bias vector [N]) for `mm` as the module docstring says, or None."""
    y = mm.outputs[0]
    info = graph.tensors[y]
    outputs = {t.name for t in graph.outputs}
    consumers = graph.consumers()
    users = consumers.get(y, [])
    if np.dtype(info.dtype).name not in DTYPES or y in outputs or len(users) != 1 or not info.shape:
        return None
    add = users[0]
    if not isinstance(add.op, Elementwise) or add.op.fn != "add" or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
    if other == y:
        return None
    found = constant_vector(graph, other, int(info.shape[-1]))
    if found is None or found[1].dtype != np.dtype(info.dtype):
        return None
    z = add.outputs[0]
    if not (_only_moves_read(consumers, z) or _read_transposed(graph, consumers, outputs, z)):
        return None
    return (add, *found)


def constant_vector(graph: BasicGraph, t: str, n: int) -> tuple[str, np.ndarray] | None:
    """(the constant, its values as a [n] vector) where `t` is a constant (or a Broadcast of one)
    varying over the last axis alone, else None."""
    src = graph.producer().get(t)
    if src is not None and isinstance(src.op, Broadcast):
        t = src.inputs[0]
    c = graph.constants.get(t)
    if c is None:
        return None
    c = np.asarray(c)
    if c.ndim == 0 or c.shape[-1] != n or int(np.prod(c.shape[:-1], dtype=np.int64)) != 1:
        return None
    return t, c.reshape(n)


def _only_moves_read(consumers: dict, t: str) -> bool:
    """Whether every path from `t` runs through moves alone into library calls or graph outputs."""
    todo, seen = [t], set()
    while todo:
        x = todo.pop()
        for n in consumers.get(x, []):
            if isinstance(n.op, LIBRARY_OPS):
                continue
            if not isinstance(n.op, _MOVES):
                return False
            if id(n) not in seen:
                seen.add(id(n))
                todo.extend(n.outputs)
    return True


def _read_transposed(graph: BasicGraph, consumers: dict, outputs: set, t: str) -> bool:
    """Whether `t` is read, and only by Transposes that move its last axis."""
    users = consumers.get(t, [])
    rank = len(graph.tensors[t].shape)
    return bool(users) and t not in outputs and all(
        isinstance(n.op, Transpose) and tuple(n.op.perm)[-1] != rank - 1 for n in users)


def _fold(graph: BasicGraph, mm: BasicNode, add: BasicNode, name: str, vector: np.ndarray) -> None:
    if graph.tensors[name].shape != vector.shape:   # a [1, ..., N] constant: its [N] copy
        name = new_constant(graph, f"{mm.outputs[0]}_bias", vector)
    op = MatMul(mm.op.trans_a, mm.op.trans_b, bias=True)
    fused = BasicNode(mm.name, op, (mm.inputs[0], mm.inputs[1], name), add.outputs, mm.origin)
    graph.tensors.pop(mm.outputs[0], None)
    graph.nodes = [fused if n is mm else n for n in graph.nodes if n is not add]
    drop_unread_broadcasts(graph)


def drop_unread_broadcasts(graph: BasicGraph) -> None:
    """Broadcasts (of a bias) that nothing reads any more."""
    while True:
        read = {t for n in graph.nodes for t in n.inputs} | {t.name for t in graph.outputs}
        dead = [n for n in graph.nodes if isinstance(n.op, Broadcast) and not any(t in read for t in n.outputs)]
        if not dead:
            return
        for n in dead:
            for t in n.outputs:
                graph.tensors.pop(t, None)
        graph.nodes = [n for n in graph.nodes if all(n is not d for d in dead)]


def new_tensor(graph: BasicGraph, base: str, shape, dtype) -> str:
    """A tensor named after `base` that the graph does not have yet, registered."""
    name = fresh_name(base, set(graph.tensors) | set(graph.constants))
    graph.tensors[name] = TensorInfo(name, tuple(int(d) for d in shape), dtype)
    return name


def new_constant(graph: BasicGraph, base: str, value: np.ndarray) -> str:
    name = new_tensor(graph, base, value.shape, value.dtype)
    graph.constants[name] = value
    return name
