"""Rules dispatched by gOperator kind (driver.by_kind) find exactly the rewrites that trying
every rule at every gOperator finds: the same trace (rule, before, after) and the same result,
on the worked examples' template plans and on random merged graphs; and no rule fires on a
gOperator kind it does not declare (`@matches`), at any position of any graph seen."""
from __future__ import annotations

import pytest
from hypothesis import given, settings

from powerfusion.frontend import import_model, partition_graph
from powerfusion.rewrite import ALL_RULES, clear_memo, optimise
from powerfusion.rewrite.base import KINDS
from powerfusion.rewrite.driver import by_kind
from powerfusion.templates.merge import enumerate_plans, lower_subgraph
from tests.rewrite import example_models as M
from tests.rewrite.gen import merged_graphs

EXAMPLES = {"channel_shuffle": M.channel_shuffle, "residual_layernorm": M.residual_layernorm,
            "scale_mask_softmax": M.scale_mask_softmax, "decode_attention": M.decode_attention}


def _merged_plans(model, limit: int = 4):
    graph = import_model(model)
    for sub in partition_graph(graph, "cuda").subgraphs:
        for choice in [None] + enumerate_plans(sub, graph, "cuda", limit=limit):
            yield lower_subgraph(sub, graph, choice, target="cuda")


def _assert_same_rewrites(merged):
    clear_memo()
    fast, fast_trace = optimise(merged)
    slow, slow_trace = optimise(merged, every_rule=True)
    assert [(s.rule, s.changed) for s in fast_trace] == [(s.rule, s.changed) for s in slow_trace]
    assert [s.after.ops for s in fast_trace] == [s.after.ops for s in slow_trace]
    assert fast.ops == slow.ops and fast.buffers == slow.buffers
    return fast_trace


def _assert_no_undeclared_hits(graphs):
    """At every gOperator, every rule not listed for its kind returns None."""
    table = by_kind(ALL_RULES)
    for g in graphs:
        for at, op in enumerate(g.ops):
            listed = {name for name, _ in table[op.kind]}
            for name, rule in ALL_RULES.items():
                if name not in listed:
                    assert rule(g, at) is None, f"'{name}' fired on a {op.kind} at {at} of {g.name}"


def test_every_rule_declares_the_kinds_it_matches():
    assert all(getattr(rule, "kinds", None) and rule.kinds <= KINDS for rule in ALL_RULES.values())
    table = by_kind(ALL_RULES)
    assert sum(len(v) for v in table.values()) < len(KINDS) * len(ALL_RULES)   # the index narrows the search


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_dispatch_finds_the_rewrites_of_every_rule_on_the_examples(name):
    steps = 0
    for merged in _merged_plans(EXAMPLES[name]()):
        trace = _assert_same_rewrites(merged)
        steps += len(trace)
        _assert_no_undeclared_hits([merged] + [s.after for s in trace])
    assert steps   # the examples do rewrite


@settings(max_examples=60, deadline=None)
@given(merged_graphs())
def test_dispatch_finds_the_rewrites_of_every_rule_on_random_graphs(case):
    g, _, _ = case
    trace = _assert_same_rewrites(g)
    _assert_no_undeclared_hits([g] + [s.after for s in trace])
