"""Gather indices must lie in [-n, n) of the gathered axis, as ONNX and onnxruntime require.

The GIR templates clamp a gathered index so that a bad one never reads outside a buffer; a
clamped index would still be a silently wrong value, so every index tensor is checked before
the step that gathers with it: one that exists between steps (a model input, a constant, a
library call's or a subgraph's output) as it is, constant indices already at import, and one
computed inside the fused subgraph that gathers with it by evaluating the nodes that make it
on the basic-op executor first (they are index arithmetic: a few small integer tensors; above
COMPUTED_INDEX_ELEMENTS of work they are not evaluated and a warning says once per node that
its indices are clamped, not checked). The GPU kernels check every gathered index in place
as well (backends/cstyle/faults.py).
"""
from __future__ import annotations

import numpy as np

from powerfusion.errors import DataError
from powerfusion.basic import BasicNode, Gather, GatherElements
from powerfusion.frontend.numpy_exec import EXECUTORS, bad_index


def gather_nodes(nodes) -> list[BasicNode]:
    return [n for n in nodes if isinstance(n.op, (Gather, GatherElements))]


COMPUTED_INDEX_ELEMENTS = 1 << 20


class UncheckedIndexWarning(UserWarning):
    """A gather's indices are computed inside a fused subgraph by more work than the check
    evaluates (COMPUTED_INDEX_ELEMENTS): out-of-range indices there are clamped."""


_WARNED: set[str] = set()


def check_gathers(nodes, env: dict, tensors: dict, step_nodes=()) -> None:
    """DataError naming the node for the first gather whose indices are out of range. Indices
    not in `env` are computed from it by their producers among `step_nodes` (the fused
    subgraph the gathers belong to)."""
    for node in nodes:
        data, idx = node.inputs[0], node.inputs[1]
        value = env[idx] if idx in env else computed_index(idx, step_nodes, env, tensors)
        if value is None:
            _warn_unchecked(node, idx)
            continue
        n = int(tensors[data].shape[node.op.axis])
        bad = bad_index(value, n)
        if bad is not None:
            o = node.origin
            raise DataError(f"node '{o.node}' ({o.op_type}, opset {o.opset}): index {bad} of '{idx}' is out of "
                            f"range for axis {node.op.axis} of size {n} of '{data}' (allowed [-{n}, {n - 1}])")


def computed_index(name: str, step_nodes, env: dict, tensors: dict):
    """Tensor `name` evaluated from `env` by the nodes among `step_nodes` that make it (on the
    basic-op executor), or None where they are too much work or it cannot be made."""
    producers = {t: n for n in step_nodes for t in n.outputs}
    chain, todo, seen = [], [name], set()
    while todo:
        t = todo.pop()
        if t in env or t in seen:
            continue
        seen.add(t)
        if t not in producers or len(producers[t].outputs) != 1:
            return None
        chain.append(producers[t])
        todo.extend(producers[t].inputs)
    if sum(int(np.prod(tensors[t].shape, dtype=np.int64)) for t in seen) > COMPUTED_INDEX_ELEMENTS:
        return None
    local = {}
    for node in sorted(set(chain), key=list(step_nodes).index):
        args = [local[i] if i in local else env[i] for i in node.inputs]
        out = tensors[node.outputs[0]]
        local[node.outputs[0]] = np.asarray(EXECUTORS[type(node.op)](node.op, args, np.dtype(out.dtype)))
    return local[name]


def _warn_unchecked(node, idx: str) -> None:
    if node.name in _WARNED:
        return
    _WARNED.add(node.name)
    import warnings
    o = node.origin
    warnings.warn(f"node '{o.node}' ({o.op_type}): its indices '{idx}' are computed inside a fused subgraph by more "
                  f"than {COMPUTED_INDEX_ELEMENTS} elements of work; out-of-range values there are clamped, not "
                  "refused", UncheckedIndexWarning, stacklevel=3)
