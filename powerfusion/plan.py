"""A compiled model as the runtimes run it: `Plan`, its steps in run order -- `LibraryStep`s
(library calls) and `KernelStep`s (memory-bound subgraphs as rewritten GIR and rendered
kernels) -- and the seconds spent in each pipeline step. The pipeline (pipeline/driver.py)
makes it; plan files (pipeline/plan_io.py) and backend runtimes read it (docs/design.md)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

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
    note: str = ""            # the plan choice's note (time budget cut, rewrites rejected)

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


class Timer:
    """Seconds per pipeline step, summed over the subgraphs (`powerfusion compile --timings`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - t0
