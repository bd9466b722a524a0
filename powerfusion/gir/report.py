"""Per-subgraph GIR reports: what the templates chose and what rewriting did to traffic and kernels.

The JSON contract (`powerfusion inspect MODEL --gir --json`) is documented in docs/gir-json.md.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from powerfusion.gir.ir import GIRGraph, Sync
from powerfusion.gir.traffic import LEVELS, kernel_count, total_bytes, traffic


def gop_counts(g: GIRGraph) -> dict[str, int]:
    """gOperators by kind (elementwise, reduce, broadcast, move, sync)."""
    return dict(sorted(Counter(op.kind for op in g.ops).items()))


def sync_counts(g: GIRGraph) -> dict[str, int]:
    """Syncs by scope label (lane, warp, block, device)."""
    return dict(sorted(Counter(op.args.scope.label for op in g.ops if isinstance(op.args, Sync)).items()))


def _bytes(g: GIRGraph) -> dict[str, int]:
    t = traffic(g)
    return {level: t[level] for level in LEVELS}


def gir_report(name: str, templates: Sequence[tuple[str, str]], before: GIRGraph, after: GIRGraph,
               trace: Sequence) -> dict:
    """One subgraph's entry of the `subgraphs` list (docs/gir-json.md)."""
    b, a = _bytes(before), _bytes(after)
    return {
        "name": name,
        "templates": [{"node": node, "template": tmpl} for node, tmpl in templates],
        "parallel": {"units": after.parallel.units, "units_per_group": after.parallel.units_per_group,
                     "lanes": after.parallel.lanes},
        "gops": {"before": gop_counts(before), "after": gop_counts(after)},
        "syncs": {"before": sync_counts(before), "after": sync_counts(after)},
        "bytes": {"before": b, "after": a},
        "total_bytes": {"before": total_bytes(b), "after": total_bytes(a)},
        "kernels_before": kernel_count(before),
        "kernels": kernel_count(after),
        "trace_length": len(trace),
        "rules": dict(sorted(Counter(step.rule for step in trace).items())),
    }


def best_rewrite(sub, graph, target: str = "cuda", plans: int = 1):
    """(before, after, trace) for a subgraph: the default template choice, or with plans > 1 the
    best of that many plans after rewriting (fewest kernels, then fewest global bytes)."""
    from powerfusion.gir.lower import enumerate_plans, lower_subgraph
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
    from powerfusion.frontend.basic import BasicGraph, Partition

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
