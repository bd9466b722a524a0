"""Structural tests of viz_data's JSON: every gOperator, every trace step, and the same
counts as `inspect --gir` (powerfusion.pipeline.inspect.inspect_gir)."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from powerfusion.gir.ir import GIRGraph, Sync
from powerfusion.gir.traffic import traffic
from powerfusion.viz import viz_data
from powerfusion.viz.gir_json import kernel_of_ops
from tests.viz.models import channel_shuffle, matmul_relu, relu_add


def _layernorm() -> GIRGraph:
    import sys, os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "backends"))
    from gir_cases import layernorm_rows
    return layernorm_rows(8, 200).graph


@dataclass(frozen=True)
class FakeStep:  # the fields the adapter reads from a rewrite TraceStep
    rule: str
    before: GIRGraph
    after: GIRGraph
    changed: tuple


def _synthetic_trace(g: GIRGraph) -> list[FakeStep]:
    """Two made-up steps: drop the last gOperator, then replace the first with a fresh uid."""
    g = replace(g, ops=tuple(replace(op, uid=k + 1) for k, op in enumerate(g.ops)))
    g1 = g.with_ops(g.ops[:-1])
    g2 = g1.with_ops((replace(g1.ops[0], uid=1000),) + g1.ops[1:])
    return [FakeStep("drop last", g, g1, (g.ops[-1].uid,)), FakeStep("renumber first", g1, g2, (1,))]


def check_stage_graph(stage: dict, g: GIRGraph) -> None:
    gj = stage["gir"]
    assert [op["uid"] for op in gj["ops"]] == [op.uid for op in g.ops]
    assert [op["kind"] for op in gj["ops"]] == [op.kind for op in g.ops]
    assert gj["traffic"] == traffic(g)
    assert gj["kernels"] == len(g.kernels())
    assert [op["kernel"] for op in gj["ops"]] == kernel_of_ops(g) or stage["kind"] == "templates"
    per_kernel = Counter(op["kernel"] for op in gj["ops"] if op["kernel"] is not None)
    assert [per_kernel[k] for k in range(len(g.kernels()))] == [len(part) for part in g.kernels()]
    ids = set(range(len(g.ops)))
    for e in gj["edges"]:
        for end in (e["source"], e["target"]):
            assert end in ids or (isinstance(end, str) and end.split(":", 1)[0] in ("in", "out")), e
    for op, gop in zip(gj["ops"], g.ops):
        assert op["describe"] == gop.describe()
        assert [s["buffer"] for s in op["inputs"]] == [s.buffer for s in gop.inputs]


def test_hand_built_gir_with_synthetic_trace():
    g = _layernorm()
    trace = _synthetic_trace(g)
    data = json.loads(json.dumps(viz_data((g, trace))))
    assert data["partition"] is None
    (sg,) = data["subgraphs"]
    kinds = [s["kind"] for s in sg["stages"]]
    assert kinds == ["merged", "rule", "rule", "final"]
    check_stage_graph(sg["stages"][0], trace[0].before)
    for stage, step in zip(sg["stages"][1:3], trace):
        assert stage["rule"] == step.rule and step.rule in stage["label"]
        assert stage["changed"] == list(step.changed)
        check_stage_graph(stage, step.after)
    assert sg["stages"][1]["removed"] == [len(g.ops)]
    assert sg["stages"][2]["added"] == [1000] and sg["stages"][2]["removed"] == [1]
    check_stage_graph(sg["stages"][3], trace[-1].after)


def test_syncs_and_slices_described():
    g = _layernorm()
    data = viz_data(g)
    ops = data["subgraphs"][0]["stages"][0]["gir"]["ops"]
    move = ops[0]
    s = g.ops[0].inputs[0]
    assert move["inputs"][0]["label"] == f"{s.level.label} {s.num}\u00d7{s.width} {s.dtype}"
    assert move["inputs"][0]["level"] == "global" and move["inputs"][0]["num"] == s.num


def _inspect(model):
    from powerfusion.frontend import import_model
    from powerfusion.frontend.partition import partition_graph
    from powerfusion.pipeline.inspect import inspect_gir
    return inspect_gir(partition_graph(import_model(model), "cuda"), target="cuda")


@pytest.mark.parametrize("make", [channel_shuffle, relu_add, matmul_relu], ids=["shuffle", "relu_add", "matmul"])
def test_counts_match_inspect_gir(make):
    model = make()
    data = viz_data(model, target="cuda", search=False)   # inspect --gir shows the default choice
    report = _inspect(model)
    assert [s["name"] for s in data["subgraphs"]] == [e["name"] for e in report["subgraphs"]]
    for sg, e in zip(data["subgraphs"], report["subgraphs"]):
        assert sg["error"] is None
        merged = next(s for s in sg["stages"] if s["kind"] == "merged")["gir"]
        final = sg["stages"][-1]["gir"]
        rules = [s for s in sg["stages"] if s["kind"] == "rule"]
        assert sg["stages"][-1]["kind"] == "final"
        assert len(rules) == sg["trace_steps"] == e["trace_length"]
        assert dict(Counter(s["rule"] for s in rules)) == e["rules"]
        for side, g in (("before", merged), ("after", final)):
            assert dict(Counter(op["kind"] for op in g["ops"])) == e["gops"][side]
            assert dict(Counter(op["scope"] for op in g["ops"] if op["kind"] == "sync")) == e["syncs"][side]
            assert g["traffic"] == e["bytes"][side] == sg["traffic"][side]
        assert merged["kernels"] == e["kernels_before"] == sg["kernels"]["before"]
        assert final["kernels"] == e["kernels"] == sg["kernels"]["after"]
        assert [(t["node"], t["template"]) for t in sg["templates"]] == \
               [(t["node"], t["template"]) for t in e["templates"]]


def test_matches_the_compile_pipeline():
    from powerfusion.compiler import compile_model
    model = channel_shuffle()
    plan = compile_model(model, "cuda")
    for source in (model, plan):
        data = viz_data(source, target="cuda")
        assert [s["name"] for s in data["subgraphs"]] == [k.name for k in plan.kernel_steps]
        for sg, step in zip(data["subgraphs"], plan.kernel_steps):
            assert sg["error"] is None
            assert [op["describe"] for op in sg["stages"][-1]["gir"]["ops"]] == [op.describe() for op in step.gir.ops]
            assert sg["kernels"]["after"] == len(step.gir.kernels()) == len(sg["sources"]) == len(step.kernels)
            assert [t["template"] for t in sg["templates"]] == [t for _, t in step.merged.templates]


def test_rule_stages_chain():
    """Each rule stage's graph is the previous stage's graph with the replaced uids gone."""
    sg = viz_data(channel_shuffle())["subgraphs"][0]
    stages = [s for s in sg["stages"] if s["kind"] != "templates"]
    assert stages[0]["kind"] == "merged" and stages[-1]["kind"] == "final"
    for prev, cur in zip(stages, stages[1:-1]):
        before = {op["uid"] for op in prev["gir"]["ops"]}
        after = {op["uid"] for op in cur["gir"]["ops"]}
        assert set(cur["changed"]) <= before
        assert set(cur["removed"]) == before - after and set(cur["added"]) == after - before
    assert stages[-1]["gir"]["ops"] == stages[-2]["gir"]["ops"] or len(stages) == 2


def test_templates_stage_has_one_cluster_per_template():
    sg = viz_data(channel_shuffle())["subgraphs"][0]
    first = sg["stages"][0]
    assert first["kind"] == "templates"
    clusters = list(dict.fromkeys(op["cluster"] for op in first["gir"]["ops"]))
    assert clusters == [f"{t['node']}: {t['template']}" for t in sg["templates"]]
    assert not any(op["kind"] == "sync" and op["scope"] == "device" for op in first["gir"]["ops"])


def test_partition_marks_library_calls_and_subgraphs():
    p = viz_data(matmul_relu(), target="cuda")["partition"]
    nodes = {n["id"]: n for n in p["nodes"]}
    assert nodes["matmul"]["kind"] == "library"
    assert nodes["relu_in"]["kind"] == nodes["sigmoid_out"]["kind"] == "subgraph"
    assert nodes["relu_in"]["step"] != nodes["sigmoid_out"]["step"]
    assert [s["kind"] for s in p["steps"]] == ["subgraph", "library", "subgraph"]
    edges = {(e["source"], e["target"], e["tensor"]) for e in p["edges"]}
    assert ("in:x", "relu_in", "x") in edges and ("relu_in", "matmul", "xr") in edges
    assert ("sigmoid_out", "out:y", "y") in edges
    assert all(e["shape"] == [256, 256] for e in p["edges"])


def test_kernel_source_lines():
    sg = viz_data(relu_add(), target="cuda")["subgraphs"][0]
    assert sg["kernels"] == {"before": 2, "after": 1}
    (src,) = sg["sources"]
    lines = src["source"].split("\n")
    final = sg["stages"][-1]["gir"]["ops"]
    for op in final:
        first, last = src["op_lines"][str(op["uid"])]
        assert 1 <= first <= last <= len(lines)


def test_lowering_failure_is_shown_not_raised(monkeypatch):
    import powerfusion.templates.merge as lower
    from powerfusion.templates.merge import LowerError

    def refuse(sub, graph, choice=None, target="cuda"):
        raise LowerError(f"no GIR template fits {sub.nodes[0].origin.op_type} (test)")
    monkeypatch.setattr(lower, "lower_subgraph", refuse)
    data = viz_data(matmul_relu(), target="cuda", search=False)   # the search may answer from its plan cache
    assert [s["failed_at"] for s in data["subgraphs"]] == ["lower", "lower"]
    assert all("Relu" in s["error"] or "Sigmoid" in s["error"] for s in data["subgraphs"])
    assert all(s["stages"] == [] for s in data["subgraphs"])
    assert {n["op_type"] for n in data["partition"]["nodes"]} == {"Relu", "MatMul", "Sigmoid"}


def test_templates_stage_traffic_is_the_templates_own():
    from powerfusion.viz import run_data, to_run
    run = to_run(channel_shuffle(), target="cuda")
    (r,) = run.runs
    total = Counter()
    for t in r.templates:
        total.update(traffic(t.graph))
    first = run_data(run)["subgraphs"][0]["stages"][0]
    assert first["kind"] == "templates" and first["gir"]["traffic"] == dict(total)


def test_a_subgraph_over_its_time_budget_is_shown_as_failed():
    import time
    t0 = time.perf_counter()
    data = viz_data(channel_shuffle(58, 28), target="cuda", timeout=0.2)
    (sg,) = data["subgraphs"]
    assert sg["failed_at"] == "timeout" and "0.2 s" in sg["error"] and sg["stages"] == []
    assert time.perf_counter() - t0 < 30
    ok = viz_data(matmul_relu(), target="cuda", timeout=120)   # the same results through the worker
    assert ok == viz_data(matmul_relu(), target="cuda")


def test_a_search_cut_short_by_its_budget_says_so(monkeypatch, tmp_path):
    """The plan search's note (here: a zero time budget) reaches the subgraph's data."""
    from functools import partial
    from powerfusion import options
    from powerfusion.pipeline import plancache, search
    monkeypatch.setattr(search, "choose_plan", partial(search.choose_plan, budget_s=0))
    plancache.clear_memo()
    try:
        with options.context(cache_dir=tmp_path):
            data = viz_data(relu_add(), target="cuda")
    finally:
        plancache.clear_memo()
    (sg,) = data["subgraphs"]
    assert sg["error"] is None and sg["stages"]
    assert "time cap: rewrote 1 of" in sg["note"] and "not tried" in sg["note"]


def test_channel_shuffle_walkthrough():
    """docs/viz.md's walk-through: four kernels (three device syncs) merged; one kernel, each
    element read once and written once, at the end. At 16 channels of 14x14: the split rule
    composes concat / split intermediates only up to patterns.SAMPLE_CAP elements (docs/viz.md
    says why the 58-channel stage of the walk-through now ends at two kernels)."""
    sg = viz_data(channel_shuffle(16, 14), target="cuda")["subgraphs"][0]
    tensor = 16 * 14 * 14 * 4                      # bytes of one input (and one output)
    stages = {s["kind"]: s for s in sg["stages"]}  # the last rule stage under "rule"
    merged, final = stages["merged"]["gir"], stages["final"]["gir"]
    assert merged["kernels"] == 4 and [op["scope"] for op in merged["ops"] if op["kind"] == "sync"] == ["device"] * 3
    round_trip = 4 * tensor                        # a and b read once, y1 and y2 written once
    assert merged["traffic"]["global"] == 3 * round_trip     # concat, transpose, split: each reads and writes it all
    assert final["kernels"] == 1 and final["traffic"]["global"] == round_trip
    assert {op["kind"] for op in final["ops"]} == {"move"}
    assert [s["kind"] for s in sg["stages"]][:2] == ["templates", "merged"] and sg["trace_steps"] >= 3
