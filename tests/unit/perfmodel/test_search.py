"""Plan search: feasible best-predicted pick, pruning, structural cache (memo, disk, renaming)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion.frontend import import_model, partition_graph
from powerfusion.gir.interpreter import run_gir
from powerfusion.templates.merge import lower_subgraph, MergePlan
from powerfusion.pipeline import plancache
from powerfusion.pipeline.search import choose_plan, optimistic_seconds
from powerfusion.targets.specs import get_target
from powerfusion.rewrite import optimise

R, N = 8, 64
H100 = get_target("h100")


def _separate_subgraphs(graph):
    """The subgraphs of a model of independent parts, each its own subgraph: horizontal fusion
    (frontend/partition.py) would make them one, and these tests are about searching several."""
    import importlib
    part = importlib.import_module("powerfusion.frontend.partition")
    cap, part.HFUSE_MAX_NODES = part.HFUSE_MAX_NODES, 0
    try:
        return partition_graph(graph, "cuda").subgraphs
    finally:
        part.HFUSE_MAX_NODES = cap


@pytest.fixture(scope="module")
def two_layernorms():
    """Two structurally identical LayerNorms with different names and weights: two subgraphs."""
    rng = np.random.default_rng(0)
    nodes = [h.make_node("LayerNormalization", ["x1", "g1", "b1"], ["y1"], axis=-1, epsilon=1e-5),
             h.make_node("LayerNormalization", ["x2", "g2", "b2"], ["y2"], axis=-1, epsilon=1e-5)]
    inits = [h.make_tensor(n, T.FLOAT, [N], rng.standard_normal(N).astype(np.float32)) for n in ("g1", "b1", "g2", "b2")]
    g = h.make_graph(nodes, "ln2", [h.make_tensor_value_info(x, T.FLOAT, [R, N]) for x in ("x1", "x2")],
                     [h.make_tensor_value_info(y, T.FLOAT, [R, N]) for y in ("y1", "y2")], inits)
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    subs = _separate_subgraphs(graph)
    assert len(subs) == 2
    return graph, subs


def _layernorm_ref(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * g + b


def test_pick_is_the_best_predicted_feasible_plan_and_computes_layernorm(two_layernorms, cache):
    graph, (sub, _) = two_layernorms
    pc = choose_plan(sub, graph, H100, limit=8, beam=3)
    assert pc.source == "search"
    assert pc.top and pc.predicted_s == min(r.predicted_s for r in pc.top)
    assert pc.rewritten + pc.pruned <= pc.considered and pc.rewritten >= 1
    assert pc.estimate is not None and pc.estimate.launches == len(pc.graph.kernels())
    x = np.random.default_rng(1).standard_normal((R, N)).astype(np.float32)
    xin = [b for b in pc.graph.inputs][0]
    out = run_gir(pc.graph, {xin: x.reshape(-1)})
    g, b = (graph.constants[t] for t in ("g1", "b1"))
    # float32 arithmetic, two-pass mean/variance over 64 elements: 1e-5 is ample
    np.testing.assert_allclose(out[pc.graph.outputs[0]].reshape(R, N), _layernorm_ref(x, g, b), rtol=1e-5, atol=1e-5)
    # the optimistic bound of the winner does not exceed its prediction (within 1%: the bound
    # keeps every register-level gOperator of the merged plan, some of which rewriting removes)
    assert optimistic_seconds(pc.merged, H100) <= pc.predicted_s * 1.01


def test_beam_limits_rewriting(two_layernorms, cache):
    graph, (sub, _) = two_layernorms
    pc = choose_plan(sub, graph, H100, limit=8, beam=1, cache=False)
    assert pc.rewritten == 1
    assert pc.pruned == pc.considered - 1 - pc.infeasible


def test_structural_key_ignores_names_but_not_shapes(two_layernorms):
    graph, (a, b) = two_layernorms
    assert plancache.structural_key(a, graph, H100) == plancache.structural_key(b, graph, H100)
    assert plancache.structural_key(a, graph, H100) != plancache.structural_key(a, graph, get_target("a100"))


def test_repeated_layer_reuses_the_decision_under_its_own_names(two_layernorms, cache):
    graph, (a, b) = two_layernorms
    first = choose_plan(a, graph, H100, limit=8, beam=3)
    second = choose_plan(b, graph, H100, limit=8, beam=3)
    assert second.source == "memo" and second.labels == first.labels
    # what a search for `b` with the same template choice would have produced
    plan = MergePlan(b, graph, H100)
    picked = {n.name: next(c for c in plan.candidates(n) if c.label == lab) for n, lab in zip(plan.nodes, first.labels)}
    expected, _ = optimise(lower_subgraph(b, graph, picked, H100))
    assert second.graph.ops == expected.ops
    assert set(second.graph.buffers) == set(expected.buffers)
    assert (second.graph.inputs, second.graph.outputs) == (expected.inputs, expected.outputs)
    assert {n for n, _ in second.graph.constants} == {n for n, _ in expected.constants}


def test_disk_cache_serves_a_fresh_process(two_layernorms, cache):
    graph, (a, _) = two_layernorms
    first = choose_plan(a, graph, H100, limit=8, beam=3)
    assert list((cache / "plans").glob("*.json"))
    plancache.clear_memo()
    again = choose_plan(a, graph, H100, limit=8, beam=3)
    assert again.source == "disk"
    assert again.graph.ops == first.graph.ops and again.labels == first.labels
    assert again.predicted_s == first.predicted_s


def test_progress_bar_on_request(two_layernorms, cache, capsys):
    """progress=True forces the (tqdm) bar, counting candidate plans; by default a bar is drawn
    only on a terminal, so captured stderr (a log, a pipe) gets none."""
    graph, (a, _) = two_layernorms
    choose_plan(a, graph, H100, limit=8, beam=2, progress=True, cache=False)
    err = capsys.readouterr().err
    assert "plan search sg" in err and " plan" in err
    choose_plan(a, graph, H100, limit=8, beam=2, cache=False)
    assert "plan search" not in capsys.readouterr().err


def test_hip_target_plans_for_wavefronts(two_layernorms, cache):
    graph, (a, _) = two_layernorms
    pc = choose_plan(a, graph, "mi250", limit=4, beam=2)
    assert pc.graph.parallel.lanes == 64


def test_choose_plans_searches_each_structure_once(two_layernorms, cache):
    from powerfusion.pipeline.search import choose_plans
    graph, subs = two_layernorms
    out = choose_plans(list(subs), graph, H100, jobs=2, limit=4, beam=2)
    assert [c.source for c in out] == ["search", "memo"]   # one structure: one search, then renamed
    assert out[0].labels == out[1].labels and out[0].graph.outputs != out[1].graph.outputs


def _layernorm_beside_softmax():
    """Two subgraphs of different structure: a LayerNorm and a Softmax on separate inputs."""
    nodes = [h.make_node("LayerNormalization", ["x1", "g", "b"], ["y1"], axis=-1),
             h.make_node("Softmax", ["x2"], ["y2"], axis=-1)]
    inits = [h.make_tensor(n, T.FLOAT, [N], np.ones(N, np.float32)) for n in ("g", "b")]
    g = h.make_graph(nodes, "two", [h.make_tensor_value_info(x, T.FLOAT, [R, N]) for x in ("x1", "x2")],
                     [h.make_tensor_value_info(y, T.FLOAT, [R, N]) for y in ("y1", "y2")], inits)
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    return graph


def test_choose_plans_spreads_distinct_structures_over_processes(cache):
    graph = _layernorm_beside_softmax()
    subs = _separate_subgraphs(graph)
    from powerfusion.pipeline.search import choose_plans
    out = choose_plans(subs, graph, H100, jobs=2, limit=4, beam=2)
    assert [c.source for c in out] == ["disk", "disk"]      # both searched in workers
    assert len(list((cache / "plans").glob("*.json"))) == 2


def _choose_two_in_worker(graph_and_subs):
    from powerfusion.pipeline.search import choose_plans
    graph, subs = graph_and_subs
    return [c.source for c in choose_plans(subs, graph, H100, jobs=2, limit=4, beam=2)]


def test_choose_plans_inside_a_pool_worker_searches_in_process(cache):
    """A multiprocessing.Pool worker is daemonic and may not fork children: choose_plans there
    searches in its own process (it raised "daemonic processes are not allowed to have
    children", found by a precompile run of the conformance cases)."""
    import multiprocessing as mp
    graph = _layernorm_beside_softmax()
    with mp.get_context("fork").Pool(1) as pool:
        sources = pool.map(_choose_two_in_worker, [(graph, _separate_subgraphs(graph))])[0]
    assert sources == ["search", "search"]


def test_merged_plan_runs_when_every_rewrite_is_rejected(two_layernorms, cache, monkeypatch):
    import powerfusion.rewrite as rw

    def broken(graph):
        raise rw.driver.RewriteInvariantError("rule broke an invariant (simulated)")

    monkeypatch.setattr(rw, "optimise", broken)
    graph, (a, _) = two_layernorms
    pc = choose_plan(a, graph, H100, limit=4, beam=4, cache=False)
    assert pc.rewritten == 2   # two rejections in a row and nothing valid: stop rewriting
    assert pc.graph is pc.merged and pc.trace == ()
    assert "rewrites rejected" in pc.note and "simulated" in pc.note
    assert pc.estimate.launches == len(pc.merged.kernels()) > 1
    x = np.random.default_rng(2).standard_normal((R, N)).astype(np.float32)
    out = run_gir(pc.graph, {pc.graph.inputs[0]: x.reshape(-1)})
    g, b = (graph.constants[t] for t in ("g1", "b1"))
    np.testing.assert_allclose(out[pc.graph.outputs[0]].reshape(R, N), _layernorm_ref(x, g, b), rtol=1e-5, atol=1e-5)


def test_the_layout_check_remembers_each_kernels_verdict(two_layernorms):
    """search._layout_refusal renders kernel by kernel and remembers each verdict by what the
    rendering reads: a kernel met again is not rendered again, and a refusal reads as rendering
    the whole graph reports it (its first RenderError)."""
    from dataclasses import replace
    from powerfusion.backends.source import RenderError
    from powerfusion.pipeline import search
    graph, (a, _) = two_layernorms
    merged = lower_subgraph(a, graph, None, H100)
    n = len(merged.kernels())
    assert n > 1
    base = type(search._renderer(H100))
    calls = []

    class Counting(base):
        def render_kernel(self, g, ops, k):
            calls.append(k)
            return super().render_kernel(g, ops, k)

    class Refusing(base):
        def render_kernel(self, g, ops, k):
            calls.append(k)
            if k == 1:
                raise RenderError("kernel 1 refused (simulated)")
            return super().render_kernel(g, ops, k)

    search._LAYOUTS.clear()
    counting = Counting()
    assert search._layout_refusal(counting, merged) == "" and calls == list(range(n))
    assert search._layout_refusal(counting, merged) == "" and len(calls) == n   # every verdict remembered
    assert search._layout_refusal(counting, replace(merged, name="other")) == "" and len(calls) == 2 * n
    refusing = Refusing()
    with pytest.raises(RenderError) as refused:
        refusing.render(merged)
    calls.clear()
    assert search._layout_refusal(refusing, merged) == f"renderer: {refused.value}" and calls == [0, 1]
    calls.clear()
    assert search._layout_refusal(refusing, merged) == f"renderer: {refused.value}" and calls == []
    search._LAYOUTS.clear()
