"""Plan search budget: a count of evaluated plans (the result depends on the subgraph alone),
and a wall-clock safety cap: the default plan is always rewritten, alternatives only while the
rewriting time fits the cap, and a cut-short search says so (PlanChoice.note, unsearched)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion.frontend import import_model, partition_graph
from powerfusion.gir.interpreter import run_gir
from powerfusion.templates.merge import lower_subgraph
from powerfusion.pipeline import search
from powerfusion.pipeline.search import choose_plan
from powerfusion.targets.specs import get_target
from powerfusion.rewrite import optimise

R, N = 8, 64
H100 = get_target("h100")


@pytest.fixture(scope="module")
def layernorm():
    rng = np.random.default_rng(0)
    node = h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    inits = [h.make_tensor(n, T.FLOAT, [N], rng.standard_normal(N).astype(np.float32)) for n in ("g", "b")]
    g = h.make_graph([node], "ln", [h.make_tensor_value_info("x", T.FLOAT, [R, N])],
                     [h.make_tensor_value_info("y", T.FLOAT, [R, N])], inits)
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    (sub,) = partition_graph(graph, "cuda").subgraphs
    return graph, sub


def _computes_layernorm(pc, graph) -> None:
    x = np.random.default_rng(1).standard_normal((R, N)).astype(np.float32)
    out = run_gir(pc.graph, {pc.graph.inputs[0]: x.reshape(-1)})[pc.graph.outputs[0]].reshape(R, N)
    m = x.mean(-1, keepdims=True)
    ref = (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * graph.constants["g"] + graph.constants["b"]
    # float32, two-pass mean/variance over 64 elements: 1e-5 is ample
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_zero_budget_rewrites_only_the_default_and_says_so(layernorm, cache):
    graph, sub = layernorm
    pc = choose_plan(sub, graph, H100, limit=8, beam=8, cache=False, budget_s=0)
    assert pc.rewritten == 1 and pc.unsearched >= 1
    assert pc.rewritten + pc.pruned + pc.unsearched + pc.infeasible == pc.considered
    assert "time cap" in pc.note and f"{pc.unsearched} not tried" in pc.note
    # the one rewritten plan is the lowering's default choice, fully rewritten
    default, _ = optimise(lower_subgraph(sub, graph, None, H100))
    assert pc.graph.ops == default.ops
    _computes_layernorm(pc, graph)


def test_no_budget_searches_as_before(layernorm, cache):
    graph, sub = layernorm
    free = choose_plan(sub, graph, H100, limit=8, beam=3, cache=False, budget_s=None)
    big = choose_plan(sub, graph, H100, limit=8, beam=3, cache=False, budget_s=1e9)
    assert free.unsearched == big.unsearched == 0 and "time cap" not in free.note
    # the beam's 3, then at most beam - 1 rewrites of the anchor polish
    assert free.rewritten == big.rewritten and 3 <= free.rewritten <= 3 + min(search.POLISH_REWRITES, 2)
    assert free.labels == big.labels and free.predicted_s == big.predicted_s


def test_budget_stops_when_one_more_rewrite_would_overrun(layernorm, cache, monkeypatch):
    graph, sub = layernorm
    clock = iter(float(k) for k in range(10_000))   # every rewrite "takes" one second
    monkeypatch.setattr(search.time, "monotonic", lambda: next(clock))
    pc = choose_plan(sub, graph, H100, limit=8, beam=8, cache=False, budget_s=2.5)
    # after one: 1 s spent + 1 s slowest <= 2.5, rewrite another; after two: 2 + 1 > 2.5, stop
    assert pc.rewritten == 2 and pc.unsearched >= 1
    assert "rewrote 2 of" in pc.note and "cap 2.5 s" in pc.note
    _computes_layernorm(pc, graph)


def test_a_cut_short_decision_is_not_reused_without_a_budget(layernorm, cache):
    graph, sub = layernorm
    cut = choose_plan(sub, graph, H100, limit=8, beam=3, budget_s=0)
    assert cut.source == "search" and cut.unsearched
    again = choose_plan(sub, graph, H100, limit=8, beam=3, budget_s=0)
    assert again.source == "memo" and again.unsearched == cut.unsearched and "time cap" in again.note
    full = choose_plan(sub, graph, H100, limit=8, beam=3, budget_s=None)
    assert full.source == "search" and full.unsearched == 0 and full.rewritten >= 3
    assert choose_plan(sub, graph, H100, limit=8, beam=3, budget_s=None).source == "memo"


def test_plan_count_bounds_the_rewrites_whatever_the_time(layernorm, cache, monkeypatch):
    graph, sub = layernorm
    clock = iter(float(k) * 1000 for k in range(10_000))   # a very slow machine: 1000 s per rewrite
    monkeypatch.setattr(search.time, "monotonic", lambda: next(clock))
    slow = choose_plan(sub, graph, H100, limit=8, beam=8, cache=False, budget_s=None, plans=2)
    monkeypatch.undo()
    fast = choose_plan(sub, graph, H100, limit=8, beam=8, cache=False, budget_s=None, plans=2)
    assert slow.rewritten == fast.rewritten == 2 and slow.unsearched == 0
    assert slow.labels == fast.labels and slow.graph.ops == fast.graph.ops
    one = choose_plan(sub, graph, H100, limit=8, beam=8, cache=False, budget_s=None, plans=1)
    default, _ = optimise(lower_subgraph(sub, graph, None, H100))
    assert one.rewritten == 1 and one.graph.ops == default.ops
    _computes_layernorm(one, graph)


def test_plan_budget_shrinks_with_the_merged_size():
    assert search.plan_budget(None, 10_000) is None
    assert search.plan_budget(14, 10) == 14
    assert search.plan_budget(14, search.PLAN_WORK // 3) == 3
    assert search.plan_budget(14, 10 * search.PLAN_WORK) == 1
