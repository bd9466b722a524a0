"""Every backend by name, in one table: what renders GIR to source, what compiles that source,
what runs a model (where one can run here), what the cost model asks of it, the devices it is
modelled on and the source file extension. The CLI, the sessions, the search, the visualiser,
the cost model and the target specs (targets/specs.py) read this table.

A backend's code lives in its own folder under `powerfusion/backends/`; entries name that code
by "module:attribute" and load it only when asked, so this module imports no backend (and the
ground floor, the cost model and the search may read it without depending on one). Adding a
backend is one folder and one `Backend(...)` line in BACKENDS (docs/design.md, "Adding a
backend").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from powerfusion.errors import PowerFusionError


@dataclass(frozen=True)
class Backend:
    name: str
    extension: str | None = None        # file extension of rendered kernels; None: renders no files
    renderer: str | None = None         # "module:Class": GIR graph -> list[KernelSource]
    toolchain: str = ""                 # what compiles the rendered source (documentation, CLI help)
    runtime: str | None = None          # "module:function" (compiled plan, options) -> executor; None: compile only
    runtime_check: str | None = None    # "module:function" raising where the runtime cannot run here
    requires: str = ""                  # what running needs, for the error when its runtime is missing
    cost_hooks: str | None = None       # module with streamed_ops(graph, ops, registers_per_lane), vector_copy(src, dst, lanes)
    render_in_search: bool = False      # the search renders each candidate to reject layouts early
    max_group_threads: int | None = None  # hardware limit on lanes x units per group, when it has one
    devices: str | None = None          # "module:DICT": device name -> TargetSpec (backends/<name>/devices.py)
    default_device: str | None = None   # the device the backend's own name (and its aliases) selects
    aliases: tuple[str, ...] = ()       # other names of the default device, e.g. "cpu-reference"

    def load_renderer(self):
        """A renderer instance, or None where this backend renders no source."""
        return _load(self.renderer)() if self.renderer else None

    def load_runtime(self):
        return _load(self.runtime) if self.runtime else None

    def check_runtime(self) -> None:
        """Raise (a PowerFusionError) where this runtime cannot run here, before anything is compiled."""
        if self.runtime_check:
            _load(self.runtime_check)()

    def load_cost_hooks(self):
        return importlib.import_module(self.cost_hooks) if self.cost_hooks else None

    def load_devices(self) -> dict:
        return _load(self.devices) if self.devices else {}


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("cpu", ".c", "powerfusion.backends.cpu.renderer:CPURenderer",
            "the system C compiler (cc -O3 -march=native -fopenmp); target cpu-reference: none",
            runtime="powerfusion.backends.cpu.session:compile_cpu_plan",
            devices="powerfusion.backends.cpu.devices:DEVICES", default_device="cpu", aliases=("cpu-reference",)),
    Backend("cuda", ".cu", "powerfusion.backends.cuda.renderer:CUDARenderer", "NVRTC / nvcc",
            runtime="powerfusion.backends.cuda.session:make_executor",
            runtime_check="powerfusion.backends.cuda.session:check_available",
            requires="an NVIDIA GPU and CuPy (pip install 'powerfusion[cuda]')",
            cost_hooks="powerfusion.backends.cstyle.cost", render_in_search=True, max_group_threads=1024,
            devices="powerfusion.backends.cuda.devices:DEVICES", default_device="h200"),
    Backend("hip", ".hip", "powerfusion.backends.hip.renderer:HIPRenderer", "hipcc",
            cost_hooks="powerfusion.backends.cstyle.cost", render_in_search=True, max_group_threads=1024,
            devices="powerfusion.backends.hip.devices:DEVICES", default_device="mi250"),
    Backend("mlu", ".mlu", "powerfusion.backends.mlu.renderer:MLURenderer", "cncc (BANG C)",
            devices="powerfusion.backends.mlu.devices:DEVICES", default_device="mlu370"),
)}


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise PowerFusionError(f"unknown backend '{name}'; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def source_backends() -> list[str]:
    """Backends that render kernel source files (`powerfusion compile`)."""
    return [b.name for b in BACKENDS.values() if b.extension]


def runnable_backends() -> list[str]:
    """Backends an InferenceSession can run on (given their runtime's requirements)."""
    return [b.name for b in BACKENDS.values() if b.runtime]


def _load(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)
