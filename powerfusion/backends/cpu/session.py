"""The CPU target's memory-bound subgraphs: rewritten GIR, run as generated C (target `cpu`)
or on the fast GIR executor (target `cpu-reference`, the numpy reference).

At session creation the compile pipeline (pipeline/driver.py, `choose="default"`) gives
every memory-bound subgraph the plan that the compiler's search always rewrites first
(pipeline/choose.py): the merge's default template choice, matched for fusion, rewritten to
a fixpoint and accepted by the same feasibility check (the verifier); where the rewrite is
rejected, the merged graph runs as lowered, as in the search. The rest
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
import functools
import threading
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from powerfusion.basic import BasicGraph, LibraryCall, Subgraph
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
    pieces: list | None = None      # the steps as runs in C (driver.Driver) and steps left to Python; None: per step
    left_out: dict = field(default_factory=dict)  # step name -> why the driver left it to Python
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
        with self._lock, (blas_on_one_thread() if self._numpy_gemms else contextlib.nullcontext()):
            yield

    @functools.cached_property
    def _numpy_gemms(self) -> bool:
        """Whether a run calls a planned library runner from Python (the driver sets the BLAS's
        threads itself)."""
        if self.pieces is None:
            return bool(self.library)
        return any(isinstance(p, LibraryCall) and p.node.name in self.library for p in self.pieces)

    @property
    def paths(self) -> dict[str, str]:
        return {n: k.path for n, k in self.kernels.items()}

    @property
    def fallbacks(self) -> dict[str, str]:
        return {n: k.fallback for n, k in self.kernels.items() if k.fallback}

    def runs(self, sub: Subgraph, graph: BasicGraph) -> bool:
        """Whether `run` computes `sub`; else the basic-op executor does: a subgraph that could
        not be lowered, or one with a zero-size input (GIR buffers hold at least one element;
        the basic-op executor gives reductions over nothing their identities, as ONNX does)."""
        if all(_empty(graph, t) for t in sub.outputs):
            return True    # nothing to compute
        return not (self.kernels[sub.name].gir is None or any(_empty(graph, t) for t in sub.inputs))

    def run(self, sub: Subgraph, env: dict[str, np.ndarray], graph: BasicGraph) -> None:
        """Run a subgraph that `runs` here: its generated C, or the fast GIR executor."""
        k = self.kernels[sub.name]
        if all(_empty(graph, t) for t in sub.outputs):   # nothing to compute (as the compiler skips it)
            for t in sub.outputs:
                info = graph.tensors[t]
                env[t] = np.empty(tuple(info.shape), np.dtype(info.dtype))
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


def compile_cpu_plan(plan, failed: dict[str, str], native: bool = True) -> CpuPlan:
    """The session's CpuPlan from the pipeline's `plan` (powerfusion.plan.Plan, each subgraph's
    default plan chosen for CPU_SESSION_TARGET); `failed`: subgraph name -> why the pipeline
    could not compile it. Those, and any that fail preparation here, run on the basic-op
    executor. With `native`, every GIR graph's generated C is compiled and loaded too."""
    t0 = time.perf_counter()
    g, steps = plan.graph, {s.name: s for s in plan.kernel_steps}
    kernels = {}
    for sub in plan.partition.subgraphs:
        if sub.name in steps:
            kernels[sub.name] = prepare(steps[sub.name], g, fast=not native)
        elif all(_empty(g, t) for t in sub.outputs):   # the pipeline skips it
            kernels[sub.name] = CpuKernel(sub, None, None, (), (), note="every output has zero elements: nothing to compute")
        else:
            kernels[sub.name] = CpuKernel(sub, None, None, (), (), fallback=failed.get(sub.name, "not compiled"))
    for k in kernels.values():
        if k.fallback:
            warnings.warn(f"subgraph {k.subgraph.name} ({len(k.subgraph.nodes)} basic ops) runs on the basic-op "
                          f"executor, not as GIR: {k.fallback}", BasicFallbackWarning, stacklevel=3)
    if native:
        kernels = compile_native(kernels)
    keep = frozenset(t.name for t in g.outputs)
    library = {}
    if native:
        from powerfusion.backends.cpu.library import library_runner
        from powerfusion.basic import LibraryCall
        for step in plan.partition.steps:
            if isinstance(step, LibraryCall) and (runner := library_runner(step.node, g)):
                library[step.node.name] = runner
    cpu = CpuPlan(kernels, 0.0, keep, library)
    if native:
        from powerfusion.backends.cpu.driver import plan_runs
        cpu.pieces, cpu.left_out = plan_runs(plan.partition, cpu)
    cpu.seconds = plan.timings.get("search", 0.0) + time.perf_counter() - t0
    return cpu


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


def prepare(step, graph: BasicGraph, fast: bool = True) -> CpuKernel:
    """A compiled subgraph (a KernelStep) made ready to run (`fast`: for the fast GIR
    executor); any failure becomes a named fallback."""
    from powerfusion.templates.merge import MergePlan
    sub = step.subgraph
    try:
        names = MergePlan(sub, graph, CPU_SESSION_TARGET).names
        gir = step.gir
        inputs = tuple((names[t], t) for t in dict.fromkeys(sub.inputs) if t not in graph.constants)
        outputs = tuple((names[t], t) for t in dict.fromkeys(sub.outputs))
        if {b for b, _ in inputs} != set(gir.inputs) or [b for b, _ in outputs] != list(gir.outputs):
            raise RuntimeError(f"GIR interface {gir.inputs} -> {gir.outputs} does not match the subgraph's "
                               f"tensors {sub.inputs} -> {sub.outputs}")
        program = FastProgram(gir) if fast else None
    except Exception as e:  # a preparation failure: named fallback, never silent
        return CpuKernel(sub, None, None, (), (), fallback=failure(e))
    return CpuKernel(sub, gir, program, inputs, outputs, note=step.note)


def failure(e: Exception) -> str:
    """How a fallback's reason names the error that caused it."""
    return f"{type(e).__name__}: {e}"[:500]
