"""Bypassing an intermediate removes the syncs that guard only it, but a WARP/BLOCK sync is a
barrier for every buffer: when another shared buffer's writes before it and reads after it
relied on it, it stays (found by the lowered-graph property test)."""
from __future__ import annotations

import numpy as np

from powerfusion import basic as B
from powerfusion.basic import BasicGraph, BasicNode, Origin, Subgraph, TensorInfo
from powerfusion.gir.interpreter import run_gir
from powerfusion.templates.merge import lower_subgraph
from powerfusion.gir.verifier import verify
from powerfusion.rewrite import optimise


def _case():
    f, o = np.dtype("float32"), Origin("random", "Random", 17)
    shapes = {"x0": (3, 4), "t0": (3, 4), "t1": (3, 3), "t2": (12,), "t3": (1, 1), "t4": (3, 3), "t5": (3, 3)}
    tensors = {n: TensorInfo(n, s, f) for n, s in shapes.items()}
    nodes = [BasicNode("n0", B.Elementwise("relu"), ("x0",), ("t0",), o),
             BasicNode("n1", B.Slice((0, 1), (3, 4), (1, 1)), ("t0",), ("t1",), o),
             BasicNode("n2", B.Reshape((12,)), ("x0",), ("t2",), o),
             BasicNode("n3", B.Reduce("max", (0, 1), True), ("t1",), ("t3",), o),
             BasicNode("n4", B.Broadcast((3, 3)), ("t3",), ("t4",), o),
             BasicNode("n5", B.Elementwise("add"), ("t1", "t4"), ("t5",), o)]
    g = BasicGraph(name="rand", inputs=[tensors["x0"]], outputs=[tensors["t2"], tensors["t5"]], tensors=tensors,
                   constants={}, nodes=nodes, opset=17, metadata={})
    return g, Subgraph("sg_rand", tuple(nodes), ("x0",), ("t2", "t5"), 0, 0)


def test_every_rewrite_step_keeps_the_barrier_shared_reads_need():
    graph, sub = _case()
    g = lower_subgraph(sub, graph)
    out, trace = optimise(g)
    for step in trace:
        verify(step.after)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    res = run_gir(out, {g.inputs[0]: x.reshape(-1)})
    t1 = np.maximum(x, 0)[:, 1:]
    np.testing.assert_allclose(res[out.outputs[-1]].reshape(3, 3), t1 + t1.max(), rtol=1e-6)
