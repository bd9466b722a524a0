"""`powerfusion inspect --gir`: every memory-bound subgraph of a model lowered, rewritten and
reported (docs/gir-json.md), as the compile pipeline (driver.py) builds it with
`choose="fewest-kernels"` and nothing rendered.
"""
from __future__ import annotations

from powerfusion.gir.report import gir_report
from powerfusion.gir.traffic import LEVELS
from powerfusion.pipeline.driver import CompileOptions, compile


def inspect_gir(model_or_partition, target: str = "cuda", shapes: dict | None = None, plans: int = 1) -> dict:
    """The GIR part of `powerfusion inspect --gir --json` for a model (path, bytes, ModelProto),
    a BasicGraph, or a Partition: every memory-bound subgraph lowered (default template choice,
    or of `plans` plans the one with the fewest kernels, then global bytes), rewritten, and
    reported (docs/gir-json.md)."""
    plan = compile(model_or_partition, target,
                   CompileOptions(shapes=shapes, choose="fewest-kernels", plans=plans, render=False,
                                  zero_size="keep", cpu_only_nodes="keep"))
    part = plan.partition
    entries = [gir_report(s.name, s.merged.templates, s.merged, s.gir, s.trace) for s in plan.kernel_steps]
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
