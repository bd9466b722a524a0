"""Runs a rewritten GIR graph's kernels on CuPy arrays (one launch per kernel, in order)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from powerfusion.backends.cstyle.faults import FAULT_WORD, FaultSite, fault_sites
from powerfusion.backends.source import KernelSource
from powerfusion.errors import DataError
from powerfusion.gir.interpreter import np_dtype


def device_dtype(name: str) -> np.dtype:
    """CuPy has no bfloat16 of ml_dtypes' kind: bf16 buffers live as uint16 bit patterns."""
    return np.dtype(np.uint16) if name == "bfloat16" else np_dtype(name)
from powerfusion.gir.ir import GIRGraph, Level


@dataclass
class LoadedKernel:
    source: KernelSource
    kernel: object  # runtime.CompiledKernel
    faults: dict = field(default_factory=dict)   # site code -> faults.FaultSite
    fault_word: object = None                     # the module's pf_fault (CuPy uint32[1]) where it has sites


class GIRExecutor:
    """Compiles (NVRTC, disk-cached) and launches the kernels of one GIR graph.

    `__call__(arrays)` takes CuPy arrays for the graph's GLOBAL input and output buffers
    (any shape, contiguous, matching element counts); scratch GLOBAL buffers are allocated once.
    `sources`: the graph's kernels as a compiled Plan already rendered them (else rendered here)."""

    def __init__(self, graph: GIRGraph, renderer=None, options: tuple[str, ...] = (), sources=None):
        import cupy
        from powerfusion.backends.cuda.renderer import CUDARenderer
        from powerfusion.backends.cuda.runtime import compile_source
        self.graph = graph
        self.sources = list(sources) if sources else (renderer or CUDARenderer()).render(graph)
        self.kernels = []
        for ks in self.sources:
            mod = compile_source(ks.source, options, name=ks.name)
            k = mod.kernel(ks.name)
            if ks.shared_bytes > 48 * 1024:  # above 48 KB a kernel must opt in to dynamic shared memory
                from cupy.cuda import driver
                driver.funcSetAttribute(k.function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        ks.shared_bytes)
            sites = fault_sites(ks.source)
            self.kernels.append(LoadedKernel(ks, k, sites, mod.word(FAULT_WORD) if sites else None))
        interface = set(graph.inputs) | set(graph.outputs)
        consts = dict(graph.constants)
        self.scratch = {}
        for b in graph.buffers:
            if b.level != Level.GLOBAL or b.name in interface:
                continue
            if b.name in consts:
                host = np.asarray(consts[b.name]).astype(np_dtype(b.dtype)).reshape(-1)
                self.scratch[b.name] = cupy.asarray(host.view(device_dtype(b.dtype)))
            else:
                self.scratch[b.name] = cupy.empty(b.size, dtype=device_dtype(b.dtype))

    @property
    def launches(self) -> int:
        return len(self.kernels)

    def __call__(self, arrays: dict, stream=None) -> None:
        env = {**self.scratch, **arrays}
        for lk in self.kernels:
            args = []
            for name, dtype, _ in lk.source.params:
                a = env[name]
                if a.size != self.graph.buffer(name).size or a.dtype != device_dtype(dtype):
                    raise ValueError(f"kernel {lk.source.name}: buffer '{name}' expects "
                                     f"{self.graph.buffer(name).size} x {dtype}, got {a.size} x {a.dtype}")
                args.append(a)
            lk.kernel.launch(lk.source.grid, lk.source.block, args, shared_mem=lk.source.shared_bytes, stream=stream)

    @property
    def has_fault_sites(self) -> bool:
        return any(lk.fault_word is not None for lk in self.kernels)

    def check_faults(self, describe=None) -> None:
        """Raise a DataError for the first run-time fault a kernel recorded (an integer division
        by zero, backends/cstyle/faults.py), clearing every kernel's record first; call it after
        the run's stream is synchronised. `describe(site)` names the ONNX node of a fault site."""
        raise_first_fault([(lk.fault_word, lk.faults) for lk in self.kernels if lk.fault_word is not None], describe)


def raise_first_fault(words, describe=None) -> None:
    """`words`: (a module's pf_fault word, its kernel's fault sites) pairs. Reads and clears
    each word; a DataError for the first that holds a site code."""
    first: FaultSite | None = None
    for word, sites in words:
        code = int(word.get()[0])
        if code:
            word.fill(0)
            first = first or sites.get(code, FaultSite(code, "div", "integer", "?"))
    if first is not None:
        raise DataError(first.message(describe(first) if describe else ""))
