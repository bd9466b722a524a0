"""tune=True on the device: the model's top plans are timed and the measured best is kept."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion import options
from powerfusion.frontend import import_model, partition_graph
from powerfusion.pipeline import plancache
from powerfusion.pipeline.search import choose_plan
from powerfusion.targets.specs import get_target

pytestmark = pytest.mark.gpu


def test_tuned_choice_is_measured_and_correct(tmp_path):
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor
    R, N = 64, 256
    node = h.make_node("Softmax", ["x"], ["y"], axis=-1)
    g = h.make_graph([node], "sm", [h.make_tensor_value_info("x", T.FLOAT, [R, N])],
                     [h.make_tensor_value_info("y", T.FLOAT, [R, N])])
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    sub = partition_graph(graph, "cuda").subgraphs[0]
    plancache.clear_memo()
    with options.context(cache_dir=tmp_path):
        pc = choose_plan(sub, graph, get_target("h100"), tune=True, limit=8, beam=4)
    assert pc.measured_s is not None and math.isfinite(pc.measured_s)
    assert pc.measured_s == min(r.measured_s for r in pc.top)
    x = np.random.default_rng(0).standard_normal((R, N)).astype(np.float32)
    ex = GIRExecutor(pc.graph)
    arrays = {pc.graph.inputs[0]: cupy.asarray(x.reshape(-1)),
              pc.graph.outputs[0]: cupy.empty(R * N, dtype=cupy.float32)}
    ex(arrays)
    e = np.exp(x - x.max(-1, keepdims=True))
    # float32 exp and sum over 256 elements: 1e-5 relative is ample
    np.testing.assert_allclose(cupy.asnumpy(arrays[pc.graph.outputs[0]]).reshape(R, N),
                               e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_bf16_plans_are_timed(tmp_path):
    """bf16 buffers go to the device as uint16 bit patterns, as the executor expects (every
    bf16 plan timed as inf before, so tune=True could not rank them)."""
    R, N = 64, 256
    node = h.make_node("Softmax", ["x"], ["y"], axis=-1)
    g = h.make_graph([node], "sm", [h.make_tensor_value_info("x", T.BFLOAT16, [R, N])],
                     [h.make_tensor_value_info("y", T.BFLOAT16, [R, N])])
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    sub = partition_graph(graph, "cuda").subgraphs[0]
    plancache.clear_memo()
    with options.context(cache_dir=tmp_path):
        pc = choose_plan(sub, graph, get_target("h100"), tune=True, limit=8, beam=4)
    assert all(math.isfinite(r.measured_s) for r in pc.top)
