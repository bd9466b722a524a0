"""Run a compiled Plan (`compiler.compile_model`) without a GPU: library steps through numpy,
every kernel step's rewritten GIR through the reference interpreter -- the graphs the CUDA
renderer turns into source, checked by value."""
from __future__ import annotations

import numpy as np

from powerfusion.compiler import LibraryStep, Plan
from powerfusion.frontend.index_check import check_gathers, gather_nodes
from powerfusion.gir.interpreter import run_gir
from powerfusion.session import run_library_op


def run_plan(plan: Plan, feeds: dict) -> dict:
    g = plan.graph
    env = dict(g.constants)
    env.update(feeds)
    for step in plan.steps:
        if isinstance(step, LibraryStep):
            node = step.call.node
            check_gathers(gather_nodes([node]), env, g.tensors)
            env[node.outputs[0]] = run_library_op(node.op, [env[i] for i in node.inputs], g.tensors[node.outputs[0]].dtype)
            continue
        sub = step.subgraph
        check_gathers(gather_nodes(sub.nodes), env, g.tensors, sub.nodes)
        consts = {n for n, _ in step.gir.constants}
        ins = {b: np.asarray(env[t]).reshape(-1) for b, t in step.buffers.items()
               if b in step.gir.inputs and b not in consts}
        out = run_gir(step.gir, ins)
        for b in step.gir.outputs:
            t = step.buffers[b]
            info = g.tensors[t]
            env[t] = out[b][:int(np.prod(info.shape, dtype=np.int64))].reshape(info.shape).astype(info.dtype)
    for sub in plan.partition.subgraphs:   # subgraphs with only zero-size outputs are not compiled
        for t in sub.outputs:
            if t not in env:
                info = g.tensors[t]
                env[t] = np.empty(tuple(info.shape), np.dtype(info.dtype))
    return env
