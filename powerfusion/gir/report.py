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

