"""Property: after EVERY single rule application the interpreter gives the basic-op reference,
and modelled traffic never rises (global bytes; total bytes only where global bytes fall) (random merged graphs over row, column and masked-chunk
tilings; the 1,000-example run on lowered basic-op subgraphs is test_property_lowered.py)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.traffic import not_worse, traffic
from powerfusion.rewrite import optimise
from powerfusion.rewrite.sync_rules import crosses_kernels
from tests.rewrite.gen import merged_graphs

# float32 through exp/tanh/sigmoid: the interpreter and numpy evaluate the same ufuncs in the
# same order, so results agree to rounding; 1e-5 relative covers fused reordering, none happens.
RTOL, ATOL = 1e-5, 1e-6


def _assert_matches(g, feeds, expected, label):
    out = run_gir(g, feeds)
    for name, ref in expected.items():
        np.testing.assert_allclose(out[name].reshape(ref.shape), ref, rtol=RTOL, atol=ATOL, err_msg=label)


@settings(max_examples=300, deadline=None)
@given(merged_graphs())
def test_every_rewrite_step_preserves_outputs_and_never_raises_traffic(case):
    g, feeds, expected = case
    _assert_matches(g, feeds, expected, "before rewriting")
    result, trace = optimise(g)
    prev = trace[0].before if trace else g
    assert prev.ops == g.ops      # the driver only numbers the gOperators (uids are not compared)
    for step in trace:
        assert step.before is prev
        _assert_matches(step.after, feeds, expected, f"after rule '{step.rule}'")
        tb, ta = traffic(step.before), traffic(step.after)
        # global bytes never rise; total bytes rise only where global bytes fall
        assert not_worse(tb, ta), step.rule
        assert not crosses_kernels(step.after), step.rule
        prev = step.after
    assert prev.ops == result.ops
    assert len(result.kernels()) <= len(g.kernels())
