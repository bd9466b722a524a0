"""How the pipeline chooses each memory-bound subgraph's GIR plan (templates -> merge ->
rewrite -> search), one function per `CompileOptions.choose`:

    "search"          the cost model's plan search (search.choose_plan), cached
    "default"         the plan the search always rewrites first: the merge's default template
                      choice, rewritten, accepted by the search's feasibility check (else run as
                      merged), cached by structural key -- the CPU session's choice (its executor's
                      cost is not what the GPU cost model ranks)
    "fewest-kernels"  of `plans` plans (1: the default choice), each merged and rewritten, the one
                      with the fewest kernels, then the fewest global bytes; not cached
                      (`powerfusion inspect --gir`, the visualiser's fallback view)

Each returns a search.PlanChoice. `stage(name)` names the step that is running for an error
report ("templates", "merge", "rewrite", "search"); `merged(graph)` sees each merged plan
before it is rewritten."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from powerfusion.basic import BasicGraph, Subgraph
from powerfusion.errors import PowerFusionError
from powerfusion.gir.ir import GIRGraph
from powerfusion.gir.traffic import kernel_count, traffic
from powerfusion import options, rewrite
from powerfusion.pipeline import plancache, search
from powerfusion.pipeline.search import PlanChoice, equivalence, feasibility
from powerfusion.targets.specs import TargetSpec
from powerfusion.templates import merge

# steps are called through their modules (merge.lower_subgraph, not a copied name), so that a
# test replacing one of them replaces it here too


def choose(how: str, sub: Subgraph, graph: BasicGraph, t: TargetSpec, *, tune: bool, plans: int,
           stage, merged) -> PlanChoice:
    if how == "search":
        with stage("search"):
            return search.choose_plan(sub, graph, t, tune=tune, **search_limits())
    if how == "default":
        return choose_default(sub, graph, t, stage)
    if how == "fewest-kernels":
        return fewest_kernels(sub, graph, t, plans, stage, merged)
    raise PowerFusionError(f"unknown plan choice '{how}'; known: search, default, fewest-kernels")


def search_limits() -> dict:
    """The search's plan count and safety cap from the settings (unset: the search's defaults)."""
    opts = options.current()
    return {k: v for k, v in (("plans", opts.search_plans), ("budget_s", opts.search_budget_s)) if v is not None}


def choose_default(sub: Subgraph, graph: BasicGraph, t: TargetSpec, stage) -> PlanChoice:
    """The default plan, rewritten, cached by structural key like the search's."""
    t0 = time.perf_counter()
    key = plancache.structural_key(sub, graph, t)
    hit = plancache.lookup(key, sub, graph, t)
    if hit is not None:
        return replace(hit, graph=_own_constants(hit.graph, sub, graph, t))
    with stage("merge"):
        merged = merge.lower_subgraph(sub, graph, None, t)
    try:
        g, trace = rewrite.optimise(merged)
        reason = feasibility(g, t) or equivalence(g, merged)
    except Exception as e:  # a rule refusing this plan rejects the rewrite, not the subgraph
        g, trace, reason = merged, [], f"rewrite: {type(e).__name__}: {e}"[:300]
    note = ""
    if reason:
        why = feasibility(merged, t)
        if why:
            raise PowerFusionError(f"subgraph {sub.name}: neither the rewritten ({reason}) nor the lowered graph "
                                   f"({why}) is feasible")
        g, trace, note = merged, [], f"rewrites rejected: {reason}; runs as lowered"
    choice = PlanChoice(g, merged, tuple(trace), considered=1, rewritten=1, key=key, source="search",
                        seconds=time.perf_counter() - t0, labels=tuple(label for _, label in merged.templates),
                        note=note[:600])
    plancache.store(key, sub, graph, t, choice)
    return replace(choice, graph=_own_constants(choice.graph, sub, graph, t))


def _own_constants(g: GIRGraph, sub: Subgraph, graph: BasicGraph, t: TargetSpec) -> GIRGraph:
    """`g` holding this subgraph's constant values. Plan and rewrite caches key on structure,
    not on float constants' values, so a cached graph may carry another subgraph's."""
    names = merge.MergePlan(sub, graph, t).names
    mine = {names[n]: np.asarray(graph.constants[n]) for n in dict.fromkeys(sub.inputs) if n in graph.constants}
    if set(mine) != {n for n, _ in g.constants}:
        raise RuntimeError(f"cached plan's constants {[n for n, _ in g.constants]} are not the subgraph's {sorted(mine)}")
    return replace(g, constants=tuple((n, mine[n]) for n, _ in g.constants))


def fewest_kernels(sub: Subgraph, graph: BasicGraph, t: TargetSpec, plans: int, stage, merged) -> PlanChoice:
    with stage("templates"):
        choices = [None] if plans <= 1 else merge.enumerate_plans(sub, graph, t, limit=plans)
    best = None
    for choice in choices:
        with stage("merge"):
            before = merge.lower_subgraph(sub, graph, choice, target=t)
        merged(before)
        with stage("rewrite"):
            after, trace = rewrite.optimise(before)
        key = (kernel_count(after), traffic(after)["global"])
        if best is None or key < best[0]:
            best = (key, before, after, trace)
    _, before, after, trace = best
    return PlanChoice(after, before, tuple(trace), considered=len(choices), rewritten=len(choices),
                      labels=tuple(label for _, label in before.templates), source="fewest-kernels")
