"""The split rule past its sample (rewrite/merge_split.py): a choice made on sampled reader units is
confirmed on every unit, so ShuffleNet-size channel shuffles compose into one kernel again (they
were left as two, twice the traffic); refits of the composed masks and indices (patterns.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from powerfusion.gir.expr import I, J, U, variables
from powerfusion.rewrite.patterns import SAMPLE_CAP, compact_mask, conjuncts, grid, _fit
from powerfusion.gir.expr import evaluate

X = I * 128 + J


def _shuffle(n):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import perfmodel_accuracy as pa
    return pa.channel_shuffle(116, 28, 28, N=n)


def test_a_mask_conjunct_is_refitted_where_the_others_hold():
    # before: the plane's "which input" test reads the element; expected: a test of the unit alone
    before = X.lt(784) & (((U * 784 + X) // 784) % 232).lt(116)
    units = np.arange(464)
    after = compact_mask(before, units, 7, 128)
    parts = conjuncts(after)
    assert len(parts) == 2 and variables(parts[1]) <= {"u"}, after
    env = grid(units, 7, 128)
    assert np.array_equal(np.broadcast_to(evaluate(before, env), (464, 7, 128)),
                          np.broadcast_to(evaluate(after, env), (464, 7, 128)))


def test_a_refit_finds_digits_of_the_divisors_ratios():
    # (u % 116) // 2 + (u % 2) * 116 needs the radix chain 2, 116: the powers of two miss it
    e = (U % 116) // 2 + (U % 2) * 116 + (U // 232) * 1000   # divisors 2, 116, 232: factors chain 2, 4, 8, 232
    units = np.arange(1000)
    f = _fit(e, units, 1, 1, np.ones((1000, 1, 1), bool))
    assert f is not None
    env = grid(units, 1, 1)
    assert np.array_equal(np.broadcast_to(evaluate(e, env), (1000, 1, 1)), np.broadcast_to(evaluate(f, env), (1000, 1, 1)))


def test_shuffle_past_the_sample_is_one_kernel_and_exact():
    from powerfusion import InferenceSession
    from powerfusion.frontend import import_model, partition_graph
    from powerfusion.rewrite import optimise
    from powerfusion.targets.specs import get_target
    from powerfusion.templates.merge import lower_subgraph
    model = _shuffle(4)
    graph = import_model(model)
    sub = partition_graph(graph, "cuda").subgraphs[0]
    merged = lower_subgraph(sub, graph, None, get_target("cuda"))
    g, _ = optimise(merged)
    reads = max(op.inputs[0].count * g.parallel.units for op in g.ops if op.inputs)
    assert reads > SAMPLE_CAP           # the split rule's sampled path
    assert len(g.kernels()) == 1
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 116, 28, 28)).astype(np.float32) for _ in range(2))
    y1, y2 = InferenceSession(model, target="cpu-reference").run(None, {"a": a, "b": b})
    x = np.concatenate([a, b], 1).reshape(4, 2, 116, 28, 28).transpose(0, 2, 1, 3, 4).reshape(4, 232, 28, 28)
    np.testing.assert_array_equal(y1, x[:, :116])
    np.testing.assert_array_equal(y2, x[:, 116:])
