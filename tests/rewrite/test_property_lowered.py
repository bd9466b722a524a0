"""Property on lowered basic-op subgraphs (templates + merge, tests/templates/strategies.py):
after EVERY single rule application the interpreter's outputs equal the basic-op reference,
the verifier accepts the graph (sync placement included), and modelled traffic never rises."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

from powerfusion.gir.interpreter import run_gir
from powerfusion.templates.merge import lower_subgraph
from powerfusion.gir.traffic import not_worse, traffic
from powerfusion.gir.verifier import verify
from powerfusion.rewrite import optimise
from powerfusion.rewrite.sync_rules import crosses_kernels
from tests.templates.strategies import basic_cases

# float32 only; the rules never reorder arithmetic (swaps move whole pointwise functions and
# max/min, which are exact), so results agree with the numpy reference to rounding.
RTOL, ATOL = 1e-5, 1e-5


def _outputs_match(g, case, ref, label):
    out = run_gir(g, case.feeds)
    for t, name in zip(dict.fromkeys(case.subgraph.outputs), g.outputs):   # lowering keeps their order
        np.testing.assert_allclose(out[name].reshape(np.shape(ref[t])), ref[t], rtol=RTOL, atol=ATOL, err_msg=label)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(basic_cases(max_ops=4, max_rank=3, max_dim=6))
def test_every_step_on_lowered_subgraphs(case):
    g = lower_subgraph(case.subgraph, case.graph)
    ref = case.reference()
    _outputs_match(g, case, ref, "before rewriting")
    result, trace = optimise(g)
    for step in trace:
        _outputs_match(step.after, case, ref, f"after rule '{step.rule}'")
        assert not_worse(traffic(step.before), traffic(step.after)), step.rule
        assert not crosses_kernels(step.after), f"register/shared data across a kernel boundary after '{step.rule}'"
    assert len(result.kernels()) <= len(g.kernels())


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(basic_cases(max_ops=4, max_rank=3, max_dim=8))
def test_verifier_accepts_every_step(case):
    g = lower_subgraph(case.subgraph, case.graph)
    verify(g)
    _, trace = optimise(g)
    for step in trace:
        verify(step.after)
