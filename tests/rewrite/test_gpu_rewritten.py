"""Rewritten GIR runs on the GPU: the worked examples and random lowered subgraphs, after
rewriting, rendered (CUDA), compiled, launched, compared with the numpy interpreter.
Tolerance: float32, 2e-5 relative and absolute (the renderer's reduction order differs)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from powerfusion.backends.cuda.renderer import CUDARenderer
from powerfusion.gir.interpreter import np_dtype, run_gir
from powerfusion.templates.merge import lower_subgraph
from powerfusion.rewrite import optimise
from tests.rewrite import example_models as M
from tests.unit.rewrite.test_examples import best_plan
from tests.templates.strategies import basic_cases

RTOL = ATOL = 2e-5


def test_rewritten_graphs_render_for_cuda():
    """CPU-only: every worked example's rewritten graph renders (one source per kernel)."""
    for model in (M.channel_shuffle(), M.residual_layernorm(), M.scale_mask_softmax(), M.decode_attention()):
        _, _, _, after = best_plan(model)
        assert len(CUDARenderer().render(after)) == len(after.kernels())


def _run_on_gpu(g, feeds):
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor, device_dtype
    ex = GIRExecutor(g)
    arrays = {n: cupy.asarray(np.ascontiguousarray(feeds[n]).reshape(-1).view(device_dtype(g.buffer(n).dtype)))
              for n in g.inputs}
    for n in g.outputs:   # poisoned, so unwritten elements show
        b = g.buffer(n)
        arrays[n] = cupy.asarray(np.full(b.size, np.nan, dtype=np_dtype(b.dtype)).view(device_dtype(b.dtype)))
    ex(arrays)
    return {n: cupy.asnumpy(arrays[n]).view(np_dtype(g.buffer(n).dtype)) for n in g.outputs}


def _compare(g, feeds):
    want = run_gir(g, feeds)
    got = _run_on_gpu(g, feeds)
    for n in g.outputs:
        np.testing.assert_allclose(got[n].astype(np.float32), want[n].astype(np.float32), RTOL, ATOL, err_msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["channel_shuffle", "residual_layernorm", "scale_mask_softmax", "decode_attention"])
def test_worked_examples_on_gpu(name):
    graph, _, _, after = best_plan(getattr(M, name)())
    rng = np.random.default_rng(0)
    feeds = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs if t.name in after.inputs}
    _compare(after, feeds)


@pytest.mark.gpu
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(basic_cases(max_ops=4, max_rank=3, max_dim=40))
def test_random_rewritten_subgraphs_on_gpu(case):
    g = lower_subgraph(case.subgraph, case.graph)
    after, _ = optimise(g)
    _compare(after, {k: v for k, v in case.feeds.items() if k in after.inputs})
