"""The one place that knows the compiler's APIs: turns a model or a compiled Plan into
`SubgraphRun`s, the visualiser's own view of a memory-bound subgraph's history.

Everything it shows is built by the compile pipeline (pipeline/driver.py), observed; if the
pipeline's or a backend's API changes, only this file changes.
A subgraph that fails at some stage keeps what was computed before the failure and
the error text: the visualiser is a debugging tool, so a failure is something to show,
not a reason to show nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from powerfusion.gir.expr import U
from powerfusion.gir.ir import GIRGraph, Parallel
from powerfusion.pipeline.driver import CompileOptions, Observer, compile, front


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


# the pipeline's step names (pipeline/driver.py) as the view names where a subgraph failed
FAILED_AT = {"templates": "lower", "merge": "lower", "rewrite": "rewrite", "render": "codegen"}


class _Recorder(Observer):
    """What the pipeline built for one subgraph, up to where it failed."""

    def __init__(self):
        self.merged_graph = self.choice = self.error = self.stage = None
        self.kernels = ()

    def merged(self, sub, merged) -> None:
        self.merged_graph = merged

    def chosen(self, sub, choice) -> None:
        self.choice = choice

    def rendered(self, sub, kernels) -> None:
        self.kernels = tuple(kernels)

    def failed(self, sub, stage, error) -> None:
        self.stage, self.error = stage, error


def run_subgraph(sub, graph, target: str, codegen: bool = True) -> SubgraphRun:
    """The default template choice merged, rewritten, rendered (the compile pipeline with
    choose="fewest-kernels" of one plan); a failure stops it and is recorded with its stage."""
    from powerfusion.basic import Partition
    rec = _Recorder()
    compile(Partition(graph, target, [sub]), target,
            CompileOptions(choose="fewest-kernels", render=codegen, keep_going=True, zero_size="keep"), (rec,))
    merged = rec.merged_graph
    if merged is None:
        if rec.error is None:
            return SubgraphRun(sub, note="every output has no elements: nothing to compute")
        return SubgraphRun(sub, error=_text(rec.error), failed_at=FAILED_AT.get(rec.stage, rec.stage))
    templates = _template_graphs(sub, graph, target, merged)
    if rec.choice is None:
        return SubgraphRun(sub, templates, merged, error=_text(rec.error), failed_at=FAILED_AT.get(rec.stage, rec.stage))
    final, trace = rec.choice.graph, _rule_steps(rec.choice.trace)
    merged = _numbered(merged, trace, final)
    if rec.error is not None:
        return SubgraphRun(sub, templates, merged, trace, final, error=_text(rec.error),
                           failed_at=FAILED_AT.get(rec.stage, rec.stage))
    return SubgraphRun(sub, templates, merged, trace, final, rec.kernels)


def from_model(model, shapes=None, target: str = "cuda", codegen: bool = True, progress=None,
               search: bool = True, timeout: float | None = None) -> ModelRun:
    """Import and partition (the pipeline's first steps); then each subgraph as `powerfusion
    compile` would build it (its perf-model search, when `search`), isolated so that one
    failure does not hide the rest, and within `timeout` seconds each where given (budget.py)."""
    from powerfusion.viz.budget import run_all
    part = front(model, target, CompileOptions(shapes=shapes, cpu_only_nodes="keep"))
    graph = part.graph
    subs = part.subgraphs

    def work(sub):
        if progress:
            progress(f"subgraph {subs.index(sub) + 1}/{len(subs)}: {sub.name} ({len(sub.nodes)} basic ops)")
        run, note = _compiled(sub, graph, part, target, codegen) if search else (None, None)
        if run is None:
            run = run_subgraph(sub, graph, target, codegen)
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
    from powerfusion.basic import Partition
    try:
        plan = compile(Partition(graph, part.target, [sub]), target, CompileOptions(render=codegen))
    except Exception as e:  # noqa: BLE001 -- the default-choice path below shows where it fails
        return None, f"the compile pipeline failed ({_text(e)}); showing the default template choice"
    run = from_plan(plan).runs[0]
    note = plan.kernel_steps[0].note or None   # e.g. the search's time budget cut, rewrites rejected
    return (replace(run, note=note) if note else run), None


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
