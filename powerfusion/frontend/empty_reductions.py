"""Reductions over an empty set are constants: a basic-graph rewrite run before the partition.

A Reduce whose input has no elements but whose output has some (ReduceLogSum over a zero-size
axis, ONNX's `*_empty_set` cases) writes the reduction's identity everywhere: 0 for sum, 1 for
prod, and for max / min the lowest / highest value of the type (-inf / +inf for floats), as the
ONNX operators define it. Generated kernels never read zero-size tensors (pipeline/driver.py
refuses such a subgraph), so without this the CUDA and HIP targets could not run such a model at
all; with it the reduction becomes a constant that later ops read like any other.
"""
from __future__ import annotations

import numpy as np

from powerfusion.basic import BasicGraph, Reduce


def identity(fn: str, dtype: np.dtype):
    """The value of `fn` over no elements, in `dtype`."""
    dtype = np.dtype(dtype)
    if fn == "sum":
        return dtype.type(0)
    if fn == "prod":
        return dtype.type(1)
    if dtype.kind in "fc" or dtype.name.startswith(("bfloat", "float")):   # ml_dtypes' floats too
        value = dtype.type(-np.inf if fn == "max" else np.inf)
        if np.isinf(np.float32(value)):
            return value
        import ml_dtypes   # a float8 without infinities (e4m3fn): its lowest / highest finite value
        info = ml_dtypes.finfo(dtype)
        return dtype.type(info.min if fn == "max" else info.max)
    if dtype.kind == "b":
        return np.bool_(fn == "min")
    info = np.iinfo(dtype)
    return dtype.type(info.min if fn == "max" else info.max)


def fold_empty_reductions(graph: BasicGraph) -> int:
    """Replace each Reduce of a zero-size input with a non-empty output by a constant; returns how
    many were replaced."""
    folded = []
    for n in graph.nodes:
        if not isinstance(n.op, Reduce):
            continue
        src, out = graph.tensors[n.inputs[0]], graph.tensors[n.outputs[0]]
        if src.size == 0 and out.size > 0:
            dtype = np.dtype(out.dtype)
            graph.constants[n.outputs[0]] = np.full(tuple(int(d) for d in out.shape), identity(n.op.fn, dtype),
                                                    dtype=dtype)
            folded.append(n)
    if folded:
        graph.nodes = [n for n in graph.nodes if all(n is not f for f in folded)]
    return len(folded)
