"""Cross-layer weight equalisation (Nagel et al., "Data-Free Quantization", 2019): the PAI notes'
weight adjustment before INT8 quantisation.

For two layers joined through a positively homogeneous op (Relu, LeakyRelu, or nothing) --
Conv -> Relu -> Conv (group 1) or Gemm -> Relu -> Gemm -- output channel i of the first and
input channel i of the second can be rescaled by 1/s_i and s_i without changing the function.
With r1_i, r2_i the channels' weight ranges (max |w|), s_i = sqrt(r1_i / r2_i) gives both the
range sqrt(r1_i * r2_i): per-tensor quantisation then wastes no bits on a few wide channels,
and the activation between the layers (scaled by 1/s_i too) gets balanced ranges as well.
Sweeps over all pairs repeat until the scales settle (chains of three or more layers).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

HOMOGENEOUS = ("Relu", "LeakyRelu", "Identity", "MaxPool")   # MaxPool: between convs only (per channel)


@dataclass(frozen=True)
class Pair:
    first: onnx.NodeProto
    second: onnx.NodeProto


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def find_pairs(model: onnx.ModelProto) -> list[Pair]:
    g = model.graph
    inits = {t.name for t in g.initializer}
    users: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}
    pairs = []
    for first in g.node:
        if not _layer(first, inits, out_side=True):
            continue
        t = first.output[0]
        while True:
            nxt = users.get(t, [])
            if len(nxt) != 1 or t in outputs:
                break
            n = nxt[0]
            if n.op_type in HOMOGENEOUS and (n.op_type != "MaxPool" or first.op_type == "Conv"):
                t = n.output[0]
                continue
            if n.op_type == first.op_type and _layer(n, inits, out_side=False) and n.input[0] == t:
                pairs.append(Pair(first, n))
            break
    return pairs


def _layer(node, inits, out_side: bool) -> bool:
    if node.op_type == "Conv":
        return _attr(node, "group", 1) == 1 and node.input[1] in inits and (len(node.input) < 3 or not node.input[2]
                                                                            or node.input[2] in inits)
    if node.op_type == "Gemm":
        return (not _attr(node, "transA", 0) and node.input[1] in inits
                and (len(node.input) < 3 or not node.input[2] or node.input[2] in inits))
    return False


def _weight_io(node, w: np.ndarray) -> tuple[int, int]:
    """(output-channel axis, input-channel axis) of the weight."""
    if node.op_type == "Conv":
        return 0, 1
    return (0, 1) if _attr(node, "transB", 0) else (1, 0)


def equalize(model: onnx.ModelProto, sweeps: int = 8) -> tuple[onnx.ModelProto, int]:
    """A copy of `model` with every Conv/Gemm pair equalised; returns (model, pairs)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    pairs = find_pairs(model)
    values = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    for _ in range(sweeps):
        for p in pairs:
            _equalize_pair(p, values)
    for name, t in inits.items():
        if name in values:
            t.CopyFrom(numpy_helper.from_array(values[name].astype(numpy_helper.to_array(t).dtype), name))
    return model, len(pairs)


def _equalize_pair(p: Pair, values: dict) -> None:
    w1, w2 = values[p.first.input[1]], values[p.second.input[1]]
    out1, _ = _weight_io(p.first, w1)
    _, in2 = _weight_io(p.second, w2)
    r1 = np.abs(np.moveaxis(w1, out1, 0)).reshape(w1.shape[out1], -1).max(1)
    r2 = np.abs(np.moveaxis(w2, in2, 0)).reshape(w2.shape[in2], -1).max(1)
    if len(r1) != len(r2):
        return
    ok = (r1 > 0) & (r2 > 0)
    s = np.ones_like(r1)
    s[ok] = np.sqrt(r1[ok] / r2[ok])
    values[p.first.input[1]] = w1 / _along(s, out1, w1.ndim)
    if len(p.first.input) > 2 and p.first.input[2]:
        values[p.first.input[2]] = values[p.first.input[2]] / s
    values[p.second.input[1]] = w2 * _along(s, in2, w2.ndim)


def _along(s: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return s.reshape(shape)
