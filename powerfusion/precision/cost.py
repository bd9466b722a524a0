"""The cost rule of AMP: is converting one node to 16 bits worth its casts?

Time of a node = max(bytes moved / bandwidth, FLOPs / peak FLOP/s of its dtype) (a roofline,
the same one the partition uses), with the target's datasheet figures. Converting halves the
bytes of its float tensors and moves its FLOPs to the 16-bit peak (tensor cores), but each
runtime fp32 input then needs a down-cast:

* produced by a memory-bound op: the cast fuses into that op's GIR kernel, which writes the
  extra 16-bit copy: 2 bytes per element;
* a graph input or a library op's output (nothing to fuse into): a cast of its own, reading
  4 and writing 2 bytes per element, plus a kernel launch.

A node is converted when its 16-bit time plus its casts is below its fp32 time; ties stay fp32.
Unknown shapes count one element per tensor (the rule then compares bytes per element).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CastCost:
    bandwidth: float       # bytes/s
    flops32: float
    flops16: float
    launch_s: float

    @staticmethod
    def for_target(name: str, dtype: str) -> "CastCost":
        from powerfusion.targets.specs import get_target
        t = get_target(name)
        return CastCost(t.bandwidth, t.peak_flops["float32"], t.peak_flops.get(dtype, t.peak_flops["float32"]),
                        t.launch_s)


def node_flops(node, rw) -> float:
    """2 x MACs of MatMul / Gemm / Conv from the output and weight shapes; 0 for other ops."""
    out = rw.elements(node.output[0]) or 0
    if node.op_type in ("MatMul", "Gemm"):
        a = rw.shapes.get(node.input[0])
        k = a[-1] if a and a[-1] else 1
        if node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute):
            k = a[0] if a and a[0] else 1
        return 2.0 * out * k
    if node.op_type in ("Conv", "ConvTranspose"):
        w = rw.shapes.get(node.input[1])
        per_out = int(np.prod(w[1:], dtype=np.int64)) if w and all(w[1:]) else 1
        return 2.0 * out * per_out
    return 0.0


def conversion_pays(node, float_inputs: list[str], rw, cost: CastCost) -> bool:
    sizes = {n: rw.elements(n) or 1 for n in list(float_inputs) + [o for o in node.output if o]}
    elems = sum(sizes.values())
    flops = node_flops(node, rw)
    t32 = max(4 * elems / cost.bandwidth, flops / cost.flops32)
    t16 = max(2 * elems / cost.bandwidth, flops / cost.flops16)
    for name in float_inputs:
        state = rw.input_state(name)
        if state == "fused":
            t16 += 2 * sizes[name] / cost.bandwidth
        elif state == "alone":   # a launch of its own, where the sizes say what a launch weighs against
            t16 += 6 * sizes[name] / cost.bandwidth + (cost.launch_s if rw.elements(name) else 0.0)
    return t16 < t32
