"""`viz_data(...)`: everything the visualiser shows, as one JSON-serialisable dict.

The format is documented in docs/viz.md ("JSON format"); the HTML viewer, the DOT
writer and `--format json` all read this dict and nothing else.
"""
from __future__ import annotations

import os

from powerfusion.viz.adapter import ModelRun, SubgraphRun, combined, from_gir, from_model, from_plan
from powerfusion.viz.gir_json import Memo, gir_json

FORMAT_VERSION = 1


def viz_data(source, *, shapes=None, target: str = "cuda", codegen: bool = True, search: bool = True,
             timeout: float | None = None, progress=None) -> dict:
    """`source`: an .onnx path, bytes or ModelProto; a compiled `powerfusion.compiler.Plan`;
    a GIRGraph (optionally `(merged, trace)` or `(merged, trace, final)`); or a ModelRun.
    For a model, `search=False` shows the default template choice instead of the perf-model
    search's (faster), `codegen=False` skips rendering kernel source, and `timeout` (seconds)
    bounds each subgraph's work (one that runs over is shown as failed)."""
    return run_data(to_run(source, shapes=shapes, target=target, codegen=codegen, search=search,
                           timeout=timeout, progress=progress))


def to_run(source, *, shapes=None, target: str = "cuda", codegen: bool = True, search: bool = True,
           timeout: float | None = None, progress=None) -> ModelRun:
    from powerfusion.gir.ir import GIRGraph
    if isinstance(source, ModelRun):
        return source
    if isinstance(source, GIRGraph):
        return from_gir(source)
    if isinstance(source, tuple) and source and isinstance(source[0], GIRGraph):
        return from_gir(*source)
    if hasattr(source, "kernel_steps") and hasattr(source, "partition"):
        return from_plan(source)
    return from_model(source, shapes, target, codegen, progress, search, timeout)


def run_data(run: ModelRun) -> dict:
    return {
        "format": "powerfusion-viz", "version": FORMAT_VERSION,
        "model": os.path.basename(str(run.name)), "target": run.target,
        "partition": partition_data(run.graph, run.partition) if run.partition is not None else None,
        "subgraphs": [subgraph_data(r) for r in run.runs],
    }


# ---- the partition: ONNX nodes, marked by the step (library call or subgraph) they went to ----

def _onnx_key(node) -> str:
    return node.origin.node or node.name


def partition_data(graph, part) -> dict:
    from powerfusion.basic import LibraryCall
    step_of: dict[str, tuple[str, str]] = {}     # basic node -> (step name, kind)
    steps = []
    for s in part.steps:
        lib = isinstance(s, LibraryCall)
        members = [s.node] if lib else list(s.nodes)
        name = s.node.name if lib else s.name
        for n in members:
            step_of[n.name] = (name, "library" if lib else "subgraph")
        steps.append({"name": name, "kind": "library" if lib else "subgraph",
                      "flops": int(s.flops), "bytes": int(s.bytes), "intensity": round(s.intensity, 4),
                      "basic_ops": len(members), "nodes": []})
    nodes: dict[str, dict] = {}
    owner: dict[str, str] = {}                   # tensor -> onnx node id producing it
    for n in graph.nodes:
        key = _onnx_key(n)
        step, kind = step_of.get(n.name, ("", "subgraph"))
        rec = nodes.get(key)
        if rec is None:
            rec = nodes[key] = {"id": key, "name": key, "op_type": n.origin.op_type, "step": step, "kind": kind,
                                "basic": [], "tensors": []}
        if kind == "library":                     # a node with a library part is shown as library
            rec["kind"], rec["step"] = kind, step
        rec["basic"].append({"name": n.name, "kind": n.kind, "op": type(n.op).__name__, "step": step,
                             "inputs": list(n.inputs), "outputs": list(n.outputs)})
        for t in n.outputs:
            owner[t] = key
    by_step = {s["name"]: s for s in steps}
    for rec in nodes.values():
        if rec["step"] in by_step:
            by_step[rec["step"]]["nodes"].append(rec["id"])
    edges, seen = [], set()
    graph_inputs = {t.name for t in graph.inputs}

    def add(src, dst, t):
        if (src, dst, t) in seen or src == dst:
            return
        seen.add((src, dst, t))
        info = graph.tensors.get(t)
        edges.append({"source": src, "target": dst, "tensor": t,
                      "shape": list(info.shape) if info else None,
                      "dtype": str(info.dtype) if info else None})
    for n in graph.nodes:
        for t in n.inputs:
            if t in owner:
                add(owner[t], _onnx_key(n), t)
            elif t in graph_inputs:
                add(f"in:{t}", _onnx_key(n), t)
    for t in graph.outputs:
        if t.name in owner:
            add(owner[t.name], f"out:{t.name}", t.name)
    for rec in nodes.values():
        rec["tensors"] = sorted({t for b in rec["basic"] for t in b["inputs"] + b["outputs"]})
    return {"nodes": list(nodes.values()), "edges": edges, "steps": steps,
            "inputs": [_tensor(t) for t in graph.inputs], "outputs": [_tensor(t) for t in graph.outputs]}


def _tensor(t) -> dict:
    return {"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype)}


# ---- one subgraph: templates, merged, every rule application, final, sources ---------------

def subgraph_data(r: SubgraphRun) -> dict:
    from powerfusion.gir.traffic import traffic
    sub = r.subgraph
    stages = []
    memo = Memo()   # the stages share most gOperators: describe each once
    both = combined(r.templates, sub.name)
    if both is not None:
        g, groups = both
        gj = gir_json(g, memo)
        for op, group in zip(gj["ops"], groups):
            op["kernel"], op["cluster"] = None, group
        stages.append(_stage("templates", "chosen templates (not merged)", gj))
    if r.merged is not None:
        stages.append(_stage("merged", "merged (DEVICE syncs between templates)", gir_json(r.merged, memo)))
    for k, step in enumerate(r.trace):
        gj = gir_json(step.after, memo)
        before, after = {op.uid for op in step.before.ops}, {op.uid for op in step.after.ops}
        stage = _stage("rule", f"rule {k + 1}: {step.rule}", gj)
        stage.update(rule=step.rule, changed=list(step.changed),
                     added=[op.uid for op in step.after.ops if op.uid not in before],
                     removed=[op.uid for op in step.before.ops if op.uid not in after])
        stages.append(stage)
    if r.final is not None:
        stages.append(_stage("final", "final (what is rendered)", gir_json(r.final, memo)))
    for s in stages:
        for op in s["gir"]["ops"]:
            op.setdefault("cluster", None if op["kernel"] is None else f"kernel {op['kernel']}")
    sources = [{"name": k.name, "source": k.source,
                "op_lines": {str(uid): list(lines) for uid, lines in getattr(k, "op_lines", {}).items()}}
               for k in r.kernels]
    before = traffic(r.merged) if r.merged is not None else None
    after = traffic(r.final) if r.final is not None else None
    return {
        "name": sub.name,
        "basic_ops": [n.name for n in sub.nodes],
        "onnx_nodes": list(dict.fromkeys(_onnx_key(n) for n in sub.nodes)),
        "inputs": list(sub.inputs), "outputs": list(sub.outputs),
        "templates": [{"node": t.node, "template": t.template, "rebuilt": t.graph is not None} for t in r.templates],
        "stages": stages,
        "trace_steps": len(r.trace),
        "traffic": {"before": before, "after": after},
        "kernels": {"before": len(r.merged.kernels()) if r.merged is not None else None,
                    "after": len(r.final.kernels()) if r.final is not None else None},
        "sources": sources,
        "error": r.error, "failed_at": r.failed_at, "note": r.note,
    }


def _stage(kind: str, label: str, gj: dict) -> dict:
    return {"kind": kind, "label": label, "rule": None, "changed": [], "added": [], "removed": [], "gir": gj}
