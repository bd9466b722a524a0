"""Cambricon MLU370 backend: a rewritten GIR graph -> BANG C kernels (one .mlu file each).

Mapping (docs/bang.md has the spellings and their sources):

* A GIR unit (lanes = 1) is one pipeline on an MLU core (IPU): it processes its whole
  REGISTER slices with vector instructions on NRAM. A task (taskId < taskDim) runs the
  units u = taskId, taskId + taskDim, ... one after the other; in the pipelined form the
  GDRAM loads of unit k+1 are issued (`__memcpy_async`) before unit k is computed and its
  stores are asynchronous too, with one `__sync_io()` per unit between the stages, on
  double-buffered NRAM (`MLUKernel.pipelined` says when that form is used).
* Levels: REGISTER -> NRAM (one arena per core, `__nram__`), SHARED -> SRAM (one arena per
  cluster, `__mlu_shared__`), GLOBAL -> GDRAM kernel parameters.
* Syncs: LANE/WARP are no-ops (one lane per unit), BLOCK is `__sync_cluster()` (a GIR group
  of units runs on the 4 cores of one cluster: CNRT_FUNC_TYPE_UNION1), DEVICE syncs split
  the graph into kernels (`GIRGraph.kernels()`), launched in order on one queue.
* Every kernel launches as CNRT_FUNC_TYPE_UNION1 (whole clusters of 4 cores).

Every file is self-contained: device code, a host launcher
`void launch_<kernel>(cnrtQueue_t queue, <kernel parameters>)` and the `PF_LAUNCH` macro
(kernel<<<dim, type, queue>>> under cncc, the emulator's launch under tests/mlu).
"""
from __future__ import annotations

import re

from powerfusion.backends.mlu.slices import c_float  # noqa: F401 -- named here too, for callers
from powerfusion.backends.cstyle.renderer import nan_propagating
from powerfusion.backends.source import KernelSource, RenderError
from powerfusion.names import sanitize
from powerfusion.gir.ir import GIRGraph, GOp, Level, Scope, Sync
from powerfusion.scalar import scalar_fn

# MLU370 (mtp_372) capacities, docs/bang.md section 3.
NRAM_BYTES = 655360
SRAM_BYTES = 4063232
CORES_PER_CLUSTER = 4
CLUSTERS = 8

# C templates of powerfusion.scalar that BANG C (and the emulator's g++) spell differently.
_SCALAR_C = {"rsqrt": "(1.0f / sqrtf({0}))", "isnan": "({0} != {0})"}


class MLURenderer:
    """BANG C for MLU370; `render(gir)` returns one KernelSource per kernel (grid = task
    dimension, block = (1, 1, 1); the launcher in the source carries the function type)."""
    lanes = 1
    nram_bytes = NRAM_BYTES
    sram_bytes = SRAM_BYTES
    cores_per_cluster = CORES_PER_CLUSTER
    clusters = CLUSTERS
    ctype = {"float32": "float", "float16": "half", "int64": "int64_t", "int32": "int32_t", "int16": "int16_t",
             "int8": "int8_t", "uint8": "uint8_t", "bool": "bool"}

    def __init__(self, pipeline: bool = True):
        self.pipeline = pipeline  # False: every kernel in the plain synchronous form

    def render(self, graph: GIRGraph) -> list[KernelSource]:
        from powerfusion.backends.mlu.kernel import MLUKernel
        if graph.parallel.lanes != self.lanes:
            raise RenderError(f"GIR graph {graph.name} was planned for {graph.parallel.lanes} lanes per unit; "
                              f"the MLU backend needs graphs built for target 'mlu370' (1 lane)")
        return [MLUKernel(self, graph, ops, f"{sanitize(graph.name)}_k{k}").render()
                for k, ops in enumerate(kernel_parts(graph))]

    # ---- scalar code (the fallback where no __bang_* instruction fits) -------------------
    def convert(self, value: str, src: str, dst: str) -> str:
        if src == dst:
            return value
        if src == "float16":
            value, src = f"__half2float({value})", "float32"
            if dst == "float32":
                return value
        if dst == "float16":
            return f"__float2half_rn((float)({value}))"
        return f"({self.ctype[dst]})({value})"

    def scalar(self, fn: str, params: dict, operands: list[str], out_dtype: str) -> str:
        """C expression of scalar function `fn` on float (or integer/bool) operands."""
        f = scalar_fn(fn)
        if fn == "cast":
            return self.convert(operands[0], "float32", out_dtype) if out_dtype == "float16" else \
                f"({self.ctype[out_dtype]})({operands[0]})"
        tmpl = re.sub(r"\{(\w+)\}f", r"{\1}", _SCALAR_C.get(fn, f.c))
        kw = {p: c_float(float(params[p])) for p in f.params}
        return nan_propagating(tmpl.format(*operands, **kw))   # max/min/clip keep NaN (ONNX)


def kernel_parts(graph: GIRGraph) -> list[tuple[GOp, ...]]:
    """graph.kernels(), each preceded by the ops that recompute the REGISTER/SHARED values it
    reads but an earlier kernel wrote: NRAM and SRAM do not survive a kernel boundary, while
    GIR lets a unit's registers live across a DEVICE sync (the rewrites produce such graphs,
    e.g. a broadcast constant computed in one kernel and used in the next). Recomputing is
    exact when the GLOBAL data those ops read is not written in between (else RenderError);
    the BLOCK syncs among them are kept."""
    local = (Level.REGISTER, Level.SHARED)
    parts = graph.kernels()
    out = []
    for k, ops in enumerate(parts):
        want, written = set(), set()
        for op in ops:
            want |= {s.buffer for s in op.inputs if s.level in local and s.buffer not in written}
            written |= {s.buffer for s in op.outputs if s.level in local}
        if not want:
            out.append(ops)
            continue
        earlier = [op for part in parts[:k] for op in part]
        keep = []
        for n in range(len(earlier) - 1, -1, -1):
            op = earlier[n]
            if isinstance(op.args, Sync):
                if op.args.scope == Scope.BLOCK and keep:
                    keep.append(op)
                continue
            if not any(s.level in local and s.buffer in want for s in op.outputs):
                continue
            for s in op.inputs:
                if s.level == Level.GLOBAL and any(o.buffer == s.buffer for later in earlier[n + 1:]
                                                   for o in later.outputs):
                    raise RenderError(f"{graph.name}: on-chip data crosses a kernel boundary and cannot be "
                                      f"recomputed: '{s.buffer}' is overwritten after {op.describe()}")
                if s.level in local:
                    want.add(s.buffer)
            keep.append(op)
        while keep and isinstance(keep[-1].args, Sync):
            keep.pop()  # syncs before the first recomputed op guard nothing
        out.append(tuple(reversed(keep)) + tuple(ops))
    return out
