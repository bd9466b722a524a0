"""The compile pipeline: ONNX model -> Plan (library calls + kernels for memory-bound subgraphs).

    import      load, check, infer shapes, fold constants, decompose into basic ops
    partition   library calls vs memory-bound subgraphs, by arithmetic intensity
    search      per subgraph: template choices x merge plans, each rewritten by the greedy
                optimiser, pruned and chosen by the performance model
    codegen     render the chosen GIR graph's kernels through the target's backend

Identical subgraphs (by structure) are searched once. `Plan.timings` holds the seconds
spent in each step (`powerfusion compile --timings`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from powerfusion.backends.registry import backend
from powerfusion.basic import BasicGraph, LibraryCall, Partition, Subgraph


@dataclass
class KernelStep:
    """A memory-bound subgraph compiled to GIR kernels."""
    subgraph: Subgraph
    merged: object            # GIRGraph before rewriting
    gir: object               # GIRGraph after rewriting (what runs)
    trace: list               # rewrite TraceSteps
    buffers: dict[str, str]   # GIR GLOBAL buffer -> model tensor name
    kernels: list = field(default_factory=list)   # KernelSource (GPU targets)
    predicted_s: float | None = None
    candidates: int = 1

    @property
    def name(self) -> str:
        return self.subgraph.name


@dataclass
class LibraryStep:
    call: LibraryCall

    @property
    def name(self) -> str:
        return self.call.node.name


@dataclass
class Plan:
    model: str
    target: str
    graph: BasicGraph
    partition: Partition
    steps: list
    timings: dict[str, float]

    @property
    def kernel_steps(self) -> list[KernelStep]:
        return [s for s in self.steps if isinstance(s, KernelStep)]

    @property
    def library_steps(self) -> list[LibraryStep]:
        return [s for s in self.steps if isinstance(s, LibraryStep)]

    def kernel_count(self) -> int:
        return sum(len(s.gir.kernels()) for s in self.kernel_steps)


class _Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - t0


def compile_model(model, target: str = "cuda", shapes=None, *, tune: bool = False, codegen: bool = True,
                  progress=None) -> Plan:
    from powerfusion.frontend import import_model
    from powerfusion.frontend.partition import partition_graph as partition
    from powerfusion.targets.specs import get_target

    timer = _Timer()
    with timer("import"):
        graph = import_model(model, shapes)
    if get_target(target).backend != "cpu":
        from powerfusion.errors import UnsupportedOpError
        from powerfusion.frontend.converters import cpu_only_nodes
        declined = cpu_only_nodes(graph)
        if declined:
            raise UnsupportedOpError(declined)
    with timer("partition"):
        part = partition(graph, target)
    return compile_partition(graph, part, target, tune=tune, codegen=codegen, progress=progress, timer=timer)


def compile_partition(graph: BasicGraph, part: Partition, target: str, *, tune: bool = False, codegen: bool = True,
                      progress=None, timer: "_Timer | None" = None) -> Plan:
    """The search and codegen steps for an already imported and partitioned model."""
    from powerfusion.targets.specs import get_target
    timer = timer or _Timer()
    renderer = backend(get_target(target).backend).load_renderer() if codegen else None
    steps, memo = [], {}
    count, total = 0, len(part.subgraphs)
    for item in part.steps:
        if isinstance(item, LibraryCall):
            steps.append(LibraryStep(item))
            continue
        if item.outputs and all(_empty(graph, t) for t in item.outputs):
            continue   # every output has no elements: nothing to compute (zero-size buffers stay unwritten)
        count += 1
        item = _without_empty(item, graph)
        _refuse_reading_nothing(item, graph)
        if progress:
            progress(f"subgraph {count}/{total}: {item.name} ({len(item.nodes)} ops)")
        with timer("search"):
            step = _compile_subgraph(item, graph, target, tune, memo)
        if renderer is not None:
            with timer("codegen"):
                step.kernels = renderer.render(step.gir)
        steps.append(step)
    return Plan(graph.name or "model", target, graph, part, steps, timer.seconds)


def _without_empty(sub: Subgraph, graph: BasicGraph) -> Subgraph:
    """The subgraph less the ops whose outputs have no elements (they compute nothing; their
    zero-size tensors need no buffer)."""
    from dataclasses import replace
    nodes = tuple(n for n in sub.nodes if not all(_empty(graph, t) for t in n.outputs))
    if len(nodes) == len(sub.nodes):
        return sub
    read = {t for n in nodes for t in n.inputs}
    return replace(sub, nodes=nodes, inputs=tuple(t for t in sub.inputs if t in read),
                   outputs=tuple(t for t in sub.outputs if not _empty(graph, t)))


def _refuse_reading_nothing(sub: Subgraph, graph: BasicGraph) -> None:
    """A kernel that makes data from a zero-size input (a reduction over nothing) is not
    generated: say so plainly rather than report an infeasible plan."""
    empty = list(dict.fromkeys(t for n in sub.nodes for t in n.inputs if _empty(graph, t)))
    if empty:
        from powerfusion.errors import UnsupportedOpError
        made = [t for t in sub.outputs if not _empty(graph, t)]
        nodes = [(n.origin.node, n.origin.op_type, n.origin.opset,
                  f"reads the zero-size tensor(s) {empty} and writes non-empty {made}: kernels over zero-size "
                  "tensors are not generated (the CPU session runs this model)")
                 for n in sub.nodes if any(t in empty for t in n.inputs)]
        raise UnsupportedOpError(nodes)


def _empty(graph: BasicGraph, tensor: str) -> bool:
    return any(int(d) == 0 for d in graph.tensors[tensor].shape)


def _compile_subgraph(sub: Subgraph, graph: BasicGraph, target: str, tune: bool, memo: dict) -> KernelStep:
    from powerfusion.templates.merge import MergePlan
    names = MergePlan(sub, graph, target).names
    # tensors a view op aliases share one buffer: name it by the subgraph's input or output
    interface = set(sub.inputs) | set(sub.outputs)
    buffers = {}
    for t, b in names.items():
        if b not in buffers or t in interface:
            buffers[b] = t
    from powerfusion import options
    from powerfusion.pipeline.search import choose_plan   # a failure to import the search is a bug: no fallback
    budget = options.current().search_budget_s   # None: the search's own default
    choice = choose_plan(sub, graph, target, tune=tune, **({} if budget is None else {"budget_s": budget}))
    return KernelStep(sub, choice.merged, choice.graph, list(choice.trace), buffers,
                      predicted_s=choice.predicted_s, candidates=getattr(choice, "considered", 1))
