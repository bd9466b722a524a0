"""The CPU target's memory-bound subgraphs: rewritten GIR, run as generated C (target `cpu`)
or on the fast GIR executor (target `cpu-reference`, the numpy reference).

At session creation every memory-bound subgraph gets the plan that the compiler's search
(pipeline.search) always rewrites first: the lowering's default template choice, matched for
fusion, rewritten to a fixpoint and accepted by the same feasibility check (the verifier);
where the rewrite is rejected, the merged graph runs as lowered, as in the search. The rest
of the search is not run: it ranks plans by a GPU-style performance model that says nothing
about this executor, whose cost is the number of gOperators and the elements they touch,
and enumerating the alternatives would double the lowering time.

The plans are made for `CPU_SESSION_TARGET`: the generic CPU spec (one lane per unit, one
unit per group, so no lane interleaving and no shared-memory tiles) under its own name, so
its decisions are cached apart from `powerfusion compile --target cpu`'s full searches --
in memory by structural key (identical layers are lowered once per process) and on disk
under the cache directory (later sessions skip lowering).

On the `cpu` target every rewritten graph is rendered to one C module (backends/cpu/renderer.py),
the modules are compiled in parallel (toolchain.py, cached on disk) and each subgraph runs as
one call into its module (runtime.py). A missing compiler is an error that says how to get one
or how to select `cpu-reference`.

A subgraph that cannot be lowered runs on the basic-op executor: never silently -- a
`BasicFallbackWarning` names it and the reason, and `CpuPlan.fallbacks` keeps the reason.
A rewritten graph the C renderer cannot render runs on the fast GIR executor, with a
`NativeFallbackWarning` and the reason kept the same way.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from powerfusion.basic import BasicGraph, Partition, Subgraph
from powerfusion.gir.fastexec import FastProgram
from powerfusion.gir.ir import GIRGraph
from powerfusion.targets.specs import get_target
from powerfusion.backends.cpu.runtime import NativeGraph

CPU_SESSION_TARGET = replace(get_target("cpu"), name="generic-CPU-session")
REFERENCE_TARGET = "cpu-reference"   # the numpy reference: fast GIR executor, no C compiler


class BasicFallbackWarning(UserWarning):
    """A memory-bound subgraph runs on the basic-op executor, not as GIR (the message says why)."""


class NativeFallbackWarning(UserWarning):
    """A memory-bound subgraph runs on the fast GIR executor, not as generated C (the message says why)."""


@dataclass(frozen=True)
class CpuKernel:
    """One memory-bound subgraph as the CPU session runs it."""
    subgraph: Subgraph
    gir: GIRGraph | None                  # the rewritten graph (None: basic-op fallback)
    program: FastProgram | None
    inputs: tuple[tuple[str, str], ...]   # (GIR buffer, model tensor) fed from the environment
    outputs: tuple[tuple[str, str], ...]  # (GIR buffer, model tensor) stored back
    fallback: str = ""                    # why the basic-op executor runs it ("" = GIR)
    note: str = ""                        # the plan choice's note (e.g. rewrites rejected, runs as lowered)
    native: NativeGraph | None = None     # the generated C module (target cpu)

    @property
    def path(self) -> str:
        """"c" (generated C), "gir" (fast GIR executor) or "basic" (basic-op executor)."""
        return "basic" if self.gir is None else "c" if self.native is not None else "gir"


@dataclass
class CpuPlan:
    kernels: dict[str, CpuKernel]   # by subgraph name
    seconds: float = 0.0            # spent compiling at session creation
    keep: frozenset = frozenset()   # model outputs: a fresh array each run (others reuse theirs)
    library: dict = field(default_factory=dict)   # library node name -> runner with planned buffers (library.py)
    _shapes: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _outputs(self, k: CpuKernel, graph: BasicGraph) -> tuple[dict, frozenset]:
        """The kernel's output shapes by buffer, and the buffers that leave the session (made once)."""
        got = self._shapes.get(k.subgraph.name)
        if got is None:
            got = self._shapes[k.subgraph.name] = ({b: tuple(graph.tensors[t].shape) for b, t in k.outputs},
                                                   frozenset(b for b, t in k.outputs if t in self.keep))
        return got

    def run_library(self, node, inputs: list[np.ndarray]) -> np.ndarray | None:
        """The step's output through its planned runner; None where it has none."""
        runner = self.library.get(node.name)
        if runner is None:
            return None
        out = runner(*inputs)
        return out.copy() if node.outputs[0] in self.keep else out

    @contextlib.contextmanager
    def running(self):
        """The context a run executes in: one run at a time (runs reuse the planned buffers), and
        the BLAS on one thread when this plan splits GEMMs itself."""
        from powerfusion.backends.cpu.library import blas_on_one_thread
        with self._lock, (blas_on_one_thread() if self.library else contextlib.nullcontext()):
            yield

    @property
    def paths(self) -> dict[str, str]:
        return {n: k.path for n, k in self.kernels.items()}

    @property
    def fallbacks(self) -> dict[str, str]:
        return {n: k.fallback for n, k in self.kernels.items() if k.fallback}

    def run(self, sub: Subgraph, env: dict[str, np.ndarray], graph: BasicGraph) -> None:
        k = self.kernels[sub.name]
        if all(_empty(graph, t) for t in sub.outputs):   # nothing to compute (as the compiler skips it)
            for t in sub.outputs:
                info = graph.tensors[t]
                env[t] = np.empty(tuple(info.shape), np.dtype(info.dtype))
            return
        if k.gir is None or any(_empty(graph, t) for t in sub.inputs):
            # a zero-size input: GIR buffers hold at least one element; the basic-op executor
            # gives reductions over nothing their identities, as ONNX does
            from powerfusion.session import execute_subgraph
            execute_subgraph(sub, env, graph)
            return
        feeds = {b: env[t] for b, t in k.inputs}
        shapes, fresh = self._outputs(k, graph)
        if k.native is not None:   # the generated C gives a zero-size output a scratch buffer itself
            out = k.native.run(feeds, shapes, fresh)
        else:
            shapes = {b: s for b, s in shapes.items() if 0 not in s}
            out = k.program.run(feeds, shapes)
        for b, t in k.outputs:   # a zero-size output's buffer holds one unused element
            info = graph.tensors[t]
            env[t] = out[b] if b in shapes else np.empty(tuple(info.shape), np.dtype(info.dtype))


def _empty(graph: BasicGraph, tensor: str) -> bool:
    return any(int(d) == 0 for d in graph.tensors[tensor].shape)


def compile_cpu_plan(partition: Partition, native: bool = True) -> CpuPlan:
    """Every subgraph's plan; with `native`, also its generated C, compiled and loaded."""
    t0 = time.perf_counter()
    from powerfusion.progress import progress_bar
    g = partition.graph
    subgraphs = progress_bar(partition.subgraphs, desc="lowering to GIR", unit="subgraph")
    kernels = {s.name: CpuKernel(s, None, None, (), (), note="every output has zero elements: nothing to compute")
               if all(_empty(g, t) for t in s.outputs) else compile_subgraph(s, g, fast=not native)
               for s in subgraphs}
    for k in kernels.values():
        if k.fallback:
            warnings.warn(f"subgraph {k.subgraph.name} ({len(k.subgraph.nodes)} basic ops) runs on the basic-op "
                          f"executor, not as GIR: {k.fallback}", BasicFallbackWarning, stacklevel=3)
    if native:
        kernels = compile_native(kernels)
    keep = frozenset(t.name for t in partition.graph.outputs)
    library = {}
    if native:
        from powerfusion.backends.cpu.library import library_runner
        from powerfusion.basic import LibraryCall
        for step in partition.steps:
            if isinstance(step, LibraryCall) and (runner := library_runner(step.node, partition.graph)):
                library[step.node.name] = runner
    return CpuPlan(kernels, time.perf_counter() - t0, keep, library)


def compile_native(kernels: dict[str, CpuKernel]) -> dict[str, CpuKernel]:
    """Render every GIR kernel to C, compile the modules in parallel and load them. A graph the
    renderer refuses keeps the fast GIR executor, with a warning; a compiler error is raised."""
    from powerfusion.backends.cpu.renderer import RenderError
    from powerfusion.backends.cpu.runtime import NativeGraph, build_module
    from powerfusion.backends.cpu.toolchain import shared_objects
    modules, out = {}, dict(kernels)
    for name, k in kernels.items():
        if k.gir is None:
            continue
        try:
            modules[name] = build_module(k.gir)
        except (RenderError, KeyError) as e:   # KeyError: a dtype the C dialect has no type for
            reason = f"C renderer: {type(e).__name__}: {e}"[:500]
            warnings.warn(f"subgraph {name} runs on the fast GIR executor, not as generated C: {reason}",
                          NativeFallbackWarning, stacklevel=4)
            out[name] = replace(k, fallback=reason, program=FastProgram(k.gir))
    libraries = shared_objects([m.source for m in modules.values()])
    for (name, module), lib in zip(modules.items(), libraries):
        out[name] = replace(kernels[name], native=NativeGraph(module, lib))
    return out


def compile_subgraph(sub: Subgraph, graph: BasicGraph, fast: bool = True) -> CpuKernel:
    """Plan, rewrite and prepare one subgraph (`fast`: for the fast GIR executor); any failure
    becomes a named fallback."""
    from powerfusion.templates.merge import MergePlan
    try:
        names = MergePlan(sub, graph, CPU_SESSION_TARGET).names
        choice = choose_default_plan(sub, graph)
        gir = choice.graph
        inputs = tuple((names[t], t) for t in dict.fromkeys(sub.inputs) if t not in graph.constants)
        outputs = tuple((names[t], t) for t in dict.fromkeys(sub.outputs))
        if {b for b, _ in inputs} != set(gir.inputs) or [b for b, _ in outputs] != list(gir.outputs):
            raise RuntimeError(f"GIR interface {gir.inputs} -> {gir.outputs} does not match the subgraph's "
                               f"tensors {sub.inputs} -> {sub.outputs}")
        program = FastProgram(gir) if fast else None
    except Exception as e:  # a lowering, rewrite or preparation failure: named fallback, never silent
        return CpuKernel(sub, None, None, (), (), fallback=f"{type(e).__name__}: {e}"[:500])
    return CpuKernel(sub, gir, program, inputs, outputs, note=choice.note)


def choose_default_plan(sub: Subgraph, graph: BasicGraph):
    """The default plan, rewritten (a search.PlanChoice), cached by structural key like the search's."""
    from powerfusion.errors import PowerFusionError
    from powerfusion.templates.merge import lower_subgraph
    from powerfusion.pipeline import plancache
    from powerfusion.pipeline.search import PlanChoice, feasibility
    from powerfusion.rewrite import optimise
    t0 = time.perf_counter()
    t = CPU_SESSION_TARGET
    key = plancache.structural_key(sub, graph, t)
    hit = plancache.lookup(key, sub, graph, t)
    if hit is not None:
        return replace(hit, graph=_own_constants(hit.graph, sub, graph))
    merged = lower_subgraph(sub, graph, None, t)
    try:
        g, trace = optimise(merged)
        reason = feasibility(g, t)
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
    return replace(choice, graph=_own_constants(choice.graph, sub, graph))


def _own_constants(g: GIRGraph, sub: Subgraph, graph: BasicGraph) -> GIRGraph:
    """`g` holding this subgraph's constant values. Plan and rewrite caches key on structure,
    not on float constants' values, so a cached graph may carry another subgraph's."""
    from powerfusion.templates.merge import MergePlan
    names = MergePlan(sub, graph, CPU_SESSION_TARGET).names
    mine = {names[t]: np.asarray(graph.constants[t]) for t in dict.fromkeys(sub.inputs) if t in graph.constants}
    if set(mine) != {n for n, _ in g.constants}:
        raise RuntimeError(f"cached plan's constants {[n for n, _ in g.constants]} are not the subgraph's {sorted(mine)}")
    return replace(g, constants=tuple((n, mine[n]) for n, _ in g.constants))
