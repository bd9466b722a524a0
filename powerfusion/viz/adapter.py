"""The one place that knows the compiler's APIs: turns a model or a compiled Plan into
`SubgraphRun`s, the visualiser's own view of a memory-bound subgraph's history.

If the lowering, rewriting, compile or backend APIs change, only this file changes.
A subgraph that fails at some stage keeps what was computed before the failure and
the error text: the visualiser is a debugging tool, so a failure is something to show,
not a reason to show nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from powerfusion.gir.expr import U
from powerfusion.gir.ir import GIRGraph, Parallel


@dataclass(frozen=True)
class RuleStep:
    rule: str
    before: GIRGraph
    after: GIRGraph
    changed: tuple[int, ...]     # uids (in `before`) replaced or removed


@dataclass(frozen=True)
class TemplateChoice:
    node: str                    # basic node name
    template: str                # template label with parameters
    graph: GIRGraph | None       # the candidate's own GIR graph, where it could be rebuilt


@dataclass(frozen=True)
class SubgraphRun:
    subgraph: object             # frontend Subgraph
    templates: tuple[TemplateChoice, ...] = ()
    merged: GIRGraph | None = None
    trace: tuple[RuleStep, ...] = ()
    final: GIRGraph | None = None
    kernels: tuple = ()          # backend KernelSource objects (name, source, op_lines)
    error: str | None = None
    failed_at: str | None = None  # "lower" | "rewrite" | "codegen"
    note: str | None = None       # e.g. why the compile pipeline's choice is not the one shown


@dataclass(frozen=True)
class ModelRun:
    name: str
    target: str
    graph: object                # frontend BasicGraph
    partition: object            # frontend Partition
    runs: tuple[SubgraphRun, ...] = field(default=())


def _rule_steps(trace) -> tuple[RuleStep, ...]:
    return tuple(RuleStep(t.rule, t.before, t.after, tuple(getattr(t, "changed", ()))) for t in trace)


def _numbered(merged: GIRGraph, trace: tuple[RuleStep, ...], final: GIRGraph | None) -> GIRGraph:
    """The merged graph with the uids the trace refers to (the driver renumbers before its first step)."""
    if trace:
        return trace[0].before
    if final is not None and len(final.ops) == len(merged.ops):
        return final
    return merged


def _template_graphs(sub, graph, target, merged: GIRGraph) -> tuple[TemplateChoice, ...]:
    """Rebuild each chosen candidate's own graph from its label (lower.py keeps only labels)."""
    try:
        from powerfusion.templates.merge import MergePlan
        plan = MergePlan(sub, graph, target)
        nodes = {n.name: n for n in plan.nodes}
    except Exception:  # labels alone are still worth showing
        plan, nodes = None, {}
    out = []
    for node_name, label in merged.templates:
        g = None
        if plan is not None and node_name in nodes:
            try:
                g = next((c.build() for c in plan.candidates(nodes[node_name]) if c.label == label), None)
            except Exception:
                g = None
        out.append(TemplateChoice(node_name, label, g))
    return tuple(out)


def _render(renderer, final: GIRGraph):
    return tuple(renderer.render(final)) if renderer is not None else ()


def _renderer(target: str):
    from powerfusion.targets.specs import get_target
    from powerfusion.backends.registry import backend
    return backend(get_target(target).backend).load_renderer()


def run_subgraph(sub, graph, target: str, renderer=None) -> SubgraphRun:
    """Lower with the default template choice, rewrite, render; stop (and record) at a failure."""
    from powerfusion.templates.merge import lower_subgraph
    from powerfusion.rewrite import optimise
    try:
        merged = lower_subgraph(sub, graph, None, target)
    except Exception as e:  # noqa: BLE001 -- shown to the user in the view
        return SubgraphRun(sub, error=_text(e), failed_at="lower")
    templates = _template_graphs(sub, graph, target, merged)
    try:
        final, trace = optimise(merged)
    except Exception as e:  # noqa: BLE001
        return SubgraphRun(sub, templates, merged, error=_text(e), failed_at="rewrite")
    trace = _rule_steps(trace)
    merged = _numbered(merged, trace, final)
    try:
        kernels = _render(renderer, final)
    except Exception as e:  # noqa: BLE001
        return SubgraphRun(sub, templates, merged, trace, final, error=_text(e), failed_at="codegen")
    return SubgraphRun(sub, templates, merged, trace, final, kernels)


def from_model(model, shapes=None, target: str = "cuda", codegen: bool = True, progress=None,
               search: bool = True, timeout: float | None = None) -> ModelRun:
    """Import and partition; then each subgraph as `powerfusion compile` would build it (its
    perf-model search, when `search`), isolated so that one failure does not hide the rest,
    and within `timeout` seconds each where given (budget.py)."""
    from powerfusion.frontend import import_model
    from powerfusion.frontend.partition import partition_graph  # the module shadows frontend.partition
    from powerfusion.viz.budget import run_all
    graph = import_model(model, shapes)
    part = partition_graph(graph, target)
    renderer = _renderer(target) if codegen else None
    subs = part.subgraphs

    def work(sub):
        if progress:
            progress(f"subgraph {subs.index(sub) + 1}/{len(subs)}: {sub.name} ({len(sub.nodes)} basic ops)")
        run, note = _compiled(sub, graph, part, target, codegen) if search else (None, None)
        if run is None:
            run = run_subgraph(sub, graph, target, renderer)
            if note:
                run = replace(run, note=note)
        return run

    def timed_out(sub, seconds):
        return SubgraphRun(sub, error=f"not finished within {seconds:g} s (lowering, search or rewriting); "
                                      f"raise --timeout to wait longer", failed_at="timeout")

    def crashed(sub, code):
        return SubgraphRun(sub, error=f"the worker process died (exit code {code})", failed_at="crash")
    runs = run_all(subs, work, timed_out, crashed, timeout)
    name = os.path.basename(str(model)) if isinstance(model, (str, os.PathLike)) else graph.name or "model"
    return ModelRun(name, target, graph, part, tuple(runs))


def _compiled(sub, graph, part, target: str, codegen: bool) -> tuple[SubgraphRun | None, str | None]:
    """(the compile pipeline's result for one subgraph, or None and why not)."""
    try:
        from powerfusion.compiler import compile_partition
    except ImportError:
        return None, None
    from powerfusion.basic import Partition
    try:
        plan = compile_partition(graph, Partition(graph, part.target, [sub]), target, codegen=codegen)
    except Exception as e:  # noqa: BLE001 -- the default-choice path below shows where it fails
        return None, f"the compile pipeline failed ({_text(e)}); showing the default template choice"
    run = from_plan(plan).runs[0]
    note = _search_note(sub, graph, target)
    return (replace(run, note=note) if note else run), None


def _search_note(sub, graph, target: str) -> str | None:
    """The plan search's note (time budget cut, rewrites rejected): the compile above left
    its decision in the plan cache, so this is a lookup, not a second search."""
    try:
        from powerfusion.pipeline.search import choose_plan
        return choose_plan(sub, graph, target).note or None
    except Exception:  # noqa: BLE001 -- the note is extra; the compiled run is shown anyway
        return None


def from_plan(plan) -> ModelRun:
    """A compiled `powerfusion.compiler.Plan`: its KernelSteps already hold merged, trace, gir, kernels."""
    runs = []
    for step in plan.kernel_steps:
        trace = _rule_steps(step.trace or _replayed(step.merged, step.gir))
        merged = _numbered(step.merged, trace, step.gir)
        templates = _template_graphs(step.subgraph, plan.graph, plan.target, step.merged)
        runs.append(SubgraphRun(step.subgraph, templates, merged, trace, step.gir, tuple(step.kernels)))
    return ModelRun(plan.model, plan.target, plan.graph, plan.partition, tuple(runs))


def _replayed(merged: GIRGraph, final: GIRGraph) -> tuple:
    """A plan restored from a cache may come without its trace: rewrite again (deterministic)
    and keep the trace if it ends where the plan did."""
    from powerfusion.rewrite import optimise
    if merged.ops == final.ops:
        return ()
    again, trace = optimise(merged)
    return tuple(trace) if again.ops == final.ops else ()


def from_gir(merged: GIRGraph, trace=(), final: GIRGraph | None = None, name: str | None = None) -> ModelRun:
    """Hand-built GIR (tests, notebooks): one pseudo-subgraph, no partition."""
    from powerfusion.basic import Subgraph
    trace = _rule_steps(trace)
    final = final if final is not None else (trace[-1].after if trace else merged)
    sub = Subgraph(name or merged.name, (), tuple(merged.inputs), tuple(merged.outputs), 0, 0)
    run = SubgraphRun(sub, (), _numbered(merged, trace, final), trace, final)
    return ModelRun(name or merged.name, "", None, None, (run,))


def combined(templates: tuple[TemplateChoice, ...], name: str) -> tuple[GIRGraph, list[str]] | None:
    """The chosen candidates side by side in one graph (not merged: no syncs), for the first
    stage, and per op the template it came from."""
    chosen = [t for t in templates if t.graph is not None]
    if not chosen:
        return None
    graphs = [t.graph for t in chosen]
    p = max((g.parallel for g in graphs), key=lambda p: p.units)
    ops, buffers, groups, uid = [], {}, [], 0
    for t in chosen:
        for b in t.graph.buffers:
            buffers.setdefault(b.name, b)
        units = t.graph.parallel.units
        for op in t.graph.ops:
            uid += 1
            if units < p.units:   # as merging does: a template with fewer units runs on the first ones
                op = replace(op, guard=U.lt(units) if op.guard is None else U.lt(units) & op.guard)
            ops.append(replace(op, uid=uid))
            groups.append(f"{t.node}: {t.template}")
    ins = tuple(dict.fromkeys(b for g in graphs for b in g.inputs))
    outs = tuple(dict.fromkeys(b for g in graphs for b in g.outputs))
    g = GIRGraph(name, Parallel(p.units, p.units_per_group, p.lanes), tuple(buffers.values()), tuple(ops), ins, outs)
    return g, groups


def _text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
