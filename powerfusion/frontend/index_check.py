"""Gather indices must lie in [-n, n) of the gathered axis, as ONNX and onnxruntime require.

The GIR templates clamp a gathered index so that a bad one never reads outside a buffer; a
clamped index would still be a silently wrong value, so every index tensor that exists
between steps (a model input, a constant, a library call's or a subgraph's output) is checked
before the step that gathers with it, and constant indices already at import.
"""
from __future__ import annotations

import numpy as np

from powerfusion.errors import DataError
from powerfusion.basic import BasicNode, Gather, GatherElements


def gather_nodes(nodes) -> list[BasicNode]:
    return [n for n in nodes if isinstance(n.op, (Gather, GatherElements))]


def bad_index(indices: np.ndarray, n: int) -> int | None:
    """An index outside [-n, n), or None when every one is inside."""
    idx = np.asarray(indices)
    if idx.size == 0:
        return None
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -n:
        return lo
    if hi >= n:
        return hi
    return None


def check_gathers(nodes, env: dict, tensors: dict) -> None:
    """DataError naming the node for the first gather whose (available) indices are out of range."""
    for node in nodes:
        data, idx = node.inputs[0], node.inputs[1]
        if idx not in env:
            continue   # made inside a fused subgraph: the template clamps it
        n = int(tensors[data].shape[node.op.axis])
        bad = bad_index(env[idx], n)
        if bad is not None:
            o = node.origin
            raise DataError(f"node '{o.node}' ({o.op_type}, opset {o.opset}): index {bad} of '{idx}' is out of "
                            f"range for axis {node.op.axis} of size {n} of '{data}' (allowed [-{n}, {n - 1}])")
