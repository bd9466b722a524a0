"""`powerfusion inspect --gir`: every memory-bound subgraph of a model lowered, rewritten and
reported (docs/gir-json.md).
"""
from __future__ import annotations

from powerfusion.basic import BasicGraph, Partition
from powerfusion.gir.report import gir_report
from powerfusion.gir.traffic import LEVELS, kernel_count, traffic


def best_rewrite(sub, graph, target: str = "cuda", plans: int = 1):
    """(before, after, trace) for a subgraph: the default template choice, or with plans > 1 the
    best of that many plans after rewriting (fewest kernels, then fewest global bytes)."""
    from powerfusion.templates.merge import enumerate_plans, lower_subgraph
    from powerfusion.rewrite import optimise

    choices = [None] if plans <= 1 else enumerate_plans(sub, graph, target, limit=plans)
    best = None
    for choice in choices:
        before = lower_subgraph(sub, graph, choice, target=target)
        after, trace = optimise(before)
        key = (kernel_count(after), traffic(after)["global"])
        if best is None or key < best[0]:
            best = (key, before, after, trace)
    return best[1:]


def inspect_gir(model_or_partition, target: str = "cuda", shapes: dict | None = None, plans: int = 1) -> dict:
    """The GIR part of `powerfusion inspect --gir --json` for a model (path, bytes, ModelProto),
    a BasicGraph, or a Partition: every memory-bound subgraph lowered (default template choice,
    or the best of `plans` plans), rewritten, and reported (docs/gir-json.md)."""
    from powerfusion.frontend import import_model
    from powerfusion.frontend.partition import partition_graph as partition

    part = model_or_partition
    if not isinstance(part, Partition):
        graph = part if isinstance(part, BasicGraph) else import_model(part, shapes)
        part = partition(graph, target)
    entries = []
    for sub in part.subgraphs:
        before, after, trace = best_rewrite(sub, part.graph, target, plans)
        entries.append(gir_report(sub.name, before.templates, before, after, trace))
    total = {"before": dict.fromkeys(LEVELS, 0), "after": dict.fromkeys(LEVELS, 0)}
    for e in entries:
        for side in total:
            for level in LEVELS:
                total[side][level] += e["bytes"][side][level]
    return {
        "model": part.graph.name,
        "target": target,
        "subgraphs": entries,
        "library_calls": len(part.library_calls),
        "kernels": sum(e["kernels"] for e in entries),
        "bytes": total,
    }
