"""The one compile pipeline: `pipeline.compile(model, target, options, observers)` -> Plan.

    import      frontend: load, check, infer shapes, fold constants, decompose into basic ops
    partition   library calls vs memory-bound subgraphs, by arithmetic intensity
    per memory-bound subgraph:
      templates   each basic op -> candidate GIR graphs
      merge       one candidate per op, merged into one GIR graph (templates/merge.py)
      rewrite     sync, swap and merge rules to a fixpoint, traced (rewrite/)
      search      the plan the cost model predicts fastest (options.choose says how: choose.py)
      render      the chosen graph's kernels -> source, through the target's backend
    plan        library steps + kernel steps in run order (plan.py)

`powerfusion compile`, both InferenceSession targets, `powerfusion inspect --gir` and the
visualiser all run this function and observe what they need through an `Observer`; nothing
else chains these steps (docs/design.md). With choose="search" (or "default"), every distinct
subgraph (by structure) is decided once, before the per-subgraph loop, across worker processes
(parallel.py); the loop then finds each decision in the plan cache. `Plan.timings` holds the
seconds spent in each step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from powerfusion.targets.registry import backend
from powerfusion.basic import BasicGraph, LibraryCall, Partition, Subgraph
from powerfusion.pipeline.choose import choose, search_limits
from powerfusion.pipeline.parallel import search_all
from powerfusion.plan import KernelStep, LibraryStep, Plan, Timer
from powerfusion.targets.specs import TargetSpec, get_target


@dataclass(frozen=True)
class CompileOptions:
    shapes: dict | str | None = None  # fixed sizes of dynamic input dimensions
    fallback: str | None = None       # "onnxruntime": unsupported nodes run there (CPU), not an error
    precision: object = "fp32"        # "fp16" | "bf16" | precision.AmpConfig: the AMP rewrite of the ONNX model
    # "refuse": for a non-CPU target, nodes only the CPU runs are an UnsupportedOpError after the
    # import; "keep": they stay (inspect and the visualiser show the rest)
    cpu_only_nodes: str = "refuse"
    choose: str = "search"            # how each subgraph's plan is chosen: "search" | "default" | "fewest-kernels"
    plans: int = 1                    # "fewest-kernels": how many plans to compare
    tune: bool = False                # "search": time the cost model's top plans on the device
    render: bool = True               # render kernel source through the target's backend
    plan_target: TargetSpec | None = None  # the spec subgraphs are planned for, where not the target's own
    keep_going: bool = False          # a failing subgraph is reported to the observers and left out
    # "refuse": ops that write nothing are dropped and a kernel reading a zero-size tensor is
    # refused (generated kernels); "keep": subgraphs stay whole (the CPU session runs zero-size
    # work on its basic-op executor)
    zero_size: str = "refuse"
    progress: Callable[[str], None] | None = None
    workers: int = 0                  # processes searching subgraphs at once (0: options.search_workers, else the cores)
    # CUDA: fp16 / bf16 2-D convolutions run on NHWC tensors (frontend/layout.py); False keeps NCHW
    channels_last: bool = True
    # CUDA: fp16 / bf16 softmax(Q K^T s + bias) V as one fused library op (frontend/attention.py)
    attention: bool = True
    # CUDA: a bias add that would be the only arithmetic of a kernel goes into the GEMM's
    # epilogue (frontend/gemm_bias.py)
    gemm_bias: bool = True
    # CUDA: MatMuls of one activation by several constant weights become one (frontend/parallel_gemm.py)
    merge_matmuls: bool = True


class Observer:
    """Subscribe to the pipeline's steps by overriding what you need (all do nothing here)."""

    def imported(self, graph: BasicGraph) -> None: ...
    def partitioned(self, partition: Partition) -> None: ...
    def merged(self, sub: Subgraph, merged) -> None: ...          # a merged plan, before rewriting
    def chosen(self, sub: Subgraph, choice) -> None: ...          # search.PlanChoice (rewritten)
    def rendered(self, sub: Subgraph, kernels: list) -> None: ...
    def failed(self, sub: Subgraph, stage: str, error: Exception) -> None: ...


def compile(model, target: str = "cuda", options: CompileOptions = CompileOptions(),
            observers: tuple[Observer, ...] = ()) -> Plan:
    """`model`: an ONNX path, bytes or ModelProto; an imported BasicGraph; or a Partition."""
    timer = Timer()
    part = front(model, target, options, observers, timer)
    graph = part.graph
    planned = options.plan_target or get_target(target)
    renderer = backend(planned.backend).load_renderer() if options.render else None
    items = [_to_compile(item, graph, options) for item in part.steps]
    items = [item for item in items if item is not None]
    if options.choose in ("search", "default") and not options.tune:
        with timer("search"):   # every distinct subgraph once, across processes (parallel.py)
            search_all([x for x in items if isinstance(x, Subgraph)], graph, planned, workers=_workers(options),
                       how=options.choose, **(search_limits() if options.choose == "search" else {}))
    steps, count, total = [], 0, len(part.subgraphs)
    for item in items:
        if isinstance(item, LibraryCall):
            steps.append(LibraryStep(item))
            continue
        count += 1
        if options.progress:
            options.progress(f"subgraph {count}/{total}: {item.name} ({len(item.nodes)} ops)")
        step = _compile_subgraph(item, graph, planned, renderer, options, observers, timer)
        if step is not None:
            steps.append(step)
    return Plan(graph.name or "model", target, graph, part, steps, timer.seconds)


def _to_compile(item, graph: BasicGraph, options: CompileOptions):
    """The step as the pipeline compiles it: None for a subgraph none of whose outputs has an
    element (nothing to compute; zero-size buffers stay unwritten), a subgraph less its empty
    ops with options.zero_size == "refuse"."""
    if isinstance(item, LibraryCall):
        return item
    if item.outputs and all(_empty(graph, t) for t in item.outputs):
        return None
    if options.zero_size == "refuse":
        item = _without_empty(item, graph)
        _refuse_reading_nothing(item, graph)
    return item


def _workers(options: CompileOptions) -> int:
    from powerfusion import options as settings
    return options.workers or settings.current().search_workers


def front(model, target: str, options: CompileOptions = CompileOptions(), observers: tuple[Observer, ...] = (),
          timer: Timer | None = None) -> Partition:
    """import -> partition (what is not given already): the steps before the subgraphs'."""
    if isinstance(model, Partition):
        return model
    timer = timer or Timer()
    graph = model
    if not isinstance(graph, BasicGraph):
        from powerfusion.frontend import import_model
        with timer("import"):
            if options.precision not in ("fp32", "float32"):   # AMP: an ONNX rewrite before the import
                from powerfusion.frontend.loader import load_model
                from powerfusion.precision import apply_precision
                model = apply_precision(load_model(model, options.shapes), options.precision, target)
            graph = import_model(model, options.shapes, fallback=options.fallback)
    if options.channels_last and get_target(target).backend == "cuda":
        from powerfusion.frontend.layout import to_channels_last
        with timer("layout"):
            to_channels_last(graph)
    if options.merge_matmuls and get_target(target).backend == "cuda":
        from powerfusion.frontend.parallel_gemm import merge_parallel_matmuls
        with timer("parallel gemms"):
            merge_parallel_matmuls(graph, target)
    if options.attention and get_target(target).backend == "cuda":
        from powerfusion.frontend.attention import fuse_attention
        from powerfusion.frontend.kv_append import fold_kv_append
        with timer("attention"):
            fuse_attention(graph)
            fold_kv_append(graph)
    if options.gemm_bias and get_target(target).backend == "cuda":
        from powerfusion.frontend.attention import read_through_reshapes
        from powerfusion.frontend.gemm_bias import fold_gemm_bias
        with timer("gemm bias"):
            if fold_gemm_bias(graph, target):
                read_through_reshapes(graph)
    from powerfusion.frontend.empty_reductions import fold_empty_reductions
    fold_empty_reductions(graph)   # a reduction over nothing is its identity, on every target
    from powerfusion.frontend.window_stack import fold_window_stacks
    fold_window_stacks(graph)      # stacked shifted slices (unfold, involution) are one Window
    if get_target(target).backend != "cpu":   # on the CPU the Window form's C is as fast (docs/gir.md)
        from powerfusion.frontend.involution import fold_involutions
        fold_involutions(graph)
    _tell(observers, "imported", graph)
    if options.cpu_only_nodes == "refuse" and get_target(target).backend != "cpu":
        _refuse_cpu_only(graph)
    from powerfusion.frontend.partition import partition_graph
    with timer("partition"):
        part = partition_graph(graph, target)
    _tell(observers, "partitioned", part)
    return part


def _compile_subgraph(sub: Subgraph, graph: BasicGraph, t: TargetSpec, renderer, options: CompileOptions,
                      observers, timer: Timer) -> KernelStep | None:
    """templates -> merge -> rewrite -> search (choose.py), then render; a failure is told to the
    observers with the step it happened in, then raised (or, with keep_going, the subgraph is left out)."""
    running = ["templates"]

    @contextlib.contextmanager
    def stage(name):
        running[0] = name
        yield

    try:
        with timer("search"):
            choice = choose(options.choose, sub, graph, t, tune=options.tune, plans=options.plans, stage=stage,
                            merged=lambda g: _tell(observers, "merged", sub, g))
        _tell(observers, "chosen", sub, choice)
        step = KernelStep(sub, choice.merged, choice.graph, list(choice.trace), _buffers(sub, graph, t),
                          predicted_s=choice.predicted_s, candidates=choice.considered, note=choice.note)
        if renderer is not None:
            running[0] = "render"
            with timer("codegen"):
                step.kernels = renderer.render(step.gir)
            _tell(observers, "rendered", sub, step.kernels)
    except Exception as e:
        _tell(observers, "failed", sub, running[0], e)
        if options.keep_going:
            return None
        raise
    return step


def _buffers(sub: Subgraph, graph: BasicGraph, t: TargetSpec) -> dict[str, str]:
    """GIR GLOBAL buffer -> model tensor; tensors a view op aliases share one buffer: it is
    named by the subgraph's input or output."""
    from powerfusion.templates.merge import MergePlan
    interface = set(sub.inputs) | set(sub.outputs)
    buffers = {}
    for tensor, b in MergePlan(sub, graph, t).names.items():
        if b not in buffers or tensor in interface:
            buffers[b] = tensor
    return buffers


def _refuse_cpu_only(graph: BasicGraph) -> None:
    from powerfusion.frontend.converters import cpu_only_nodes
    declined = cpu_only_nodes(graph)
    if declined:
        from powerfusion.errors import UnsupportedOpError
        raise UnsupportedOpError(declined)


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


def _tell(observers, event: str, *args) -> None:
    for o in observers:
        getattr(o, event)(*args)
