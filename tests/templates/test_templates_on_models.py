"""Every memory-bound subgraph of a real CNN (the onnx package's light ShuffleNet) lowers with
the default choice and verifies; the smallest ones also run and match the basic reference."""
from __future__ import annotations

import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")


@pytest.mark.slow
def test_shufflenet_subgraphs_lower_and_verify():
    from powerfusion.frontend import import_model, partition_graph
    from powerfusion.frontend.numpy_exec import EXECUTORS
    from powerfusion.gir.interpreter import run_gir
    from powerfusion.templates.merge import lower_subgraph
    from powerfusion.gir.verifier import verify
    from powerfusion.templates.common import sanitize
    from tests.templates.helpers import assert_close

    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_shufflenet.onnx")
    if not os.path.exists(path):
        pytest.skip("light_shufflenet.onnx not shipped with this onnx")
    g = import_model(path)
    subs = partition_graph(g, "cuda").subgraphs
    assert subs
    env = dict(g.constants)
    rng = np.random.default_rng(0)
    for t in g.inputs:
        env[t.name] = rng.standard_normal(t.shape).astype(t.dtype)
    for n in g.nodes:
        info = g.tensors[n.outputs[0]]
        env[n.outputs[0]] = np.asarray(EXECUTORS[type(n.op)](n.op, [env[i] for i in n.inputs], info.dtype)
                                       ).astype(info.dtype).reshape(info.shape)
    size = {s.name: sum(g.tensors[t].size for t in s.outputs) for s in subs}
    small = set(sorted(size, key=size.get)[:4])
    for sub in subs:
        gir = lower_subgraph(sub, g, None, "cuda")
        verify(gir)
        if sub.name in small:
            out = run_gir(gir, {sanitize(t): env[t] for t in sub.inputs if t not in g.constants})
            for t in sub.outputs:
                assert_close(out[sanitize(t)].reshape(g.tensors[t].shape), env[t], f"{sub.name}:{t}")
