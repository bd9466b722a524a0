"""Runs a GIR graph's generated C module: one ctypes call per memory-bound subgraph.

Buffers are planned once: scratch GLOBAL buffers (data passed between the graph's kernels)
and constants are allocated when the module is loaded, and each output the caller does
not hand over to the user is written into an array allocated once and reused every run.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerfusion.gir.interpreter import np_dtype
from powerfusion.gir.ir import GIRGraph, Level
from powerfusion.names import sanitize


@dataclass(frozen=True)
class NativeModule:
    """A GIR graph's C source and the buffers its entry point takes, in order."""
    graph: GIRGraph
    source: str
    buffers: tuple[str, ...]


def build_module(graph: GIRGraph) -> NativeModule:
    from powerfusion.backends.cpu.renderer import module_buffers, render_module
    source, kernels = render_module(graph)
    return NativeModule(graph, source, tuple(module_buffers(kernels)))


def _openmp_waits_passively() -> None:
    """OpenMP threads spin after each parallel loop by default; next to numpy's BLAS threads
    (and other processes) on few cores that spinning takes the cores the others need: bert_small
    on a busy 2-core machine ran in 800 ms spinning, 26 ms passive. Read by libgomp when it is
    loaded, so set before the first module is; a value the user set is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")


class NativeGraph:
    """A loaded module. `run(feeds, shapes, fresh)`: feeds by GIR input buffer; returns the
    outputs by buffer, shaped as `shapes` says. Outputs named in `fresh` get a new array each
    run (they leave the session); the others are reused."""

    def __init__(self, module: NativeModule, library: Path):
        self.module, self.graph = module, module.graph
        _openmp_waits_passively()
        self._lib = ctypes.CDLL(str(library))   # kept: the function lives as long as the library
        self._fn = getattr(self._lib, f"pf_run_{sanitize(self.graph.name)}")
        self._fn.restype, self._fn.argtypes = None, [ctypes.c_void_p]
        g = self.graph
        self._slot = {b: k for k, b in enumerate(module.buffers)}
        self._args = (ctypes.c_void_p * max(1, len(module.buffers)))()
        self._keep: dict[str, np.ndarray] = {}
        consts = dict(g.constants)
        interface = set(g.inputs) | set(g.outputs)
        for b in g.buffers:
            if b.level != Level.GLOBAL or b.name not in self._slot:
                continue
            if b.name in consts:
                self._bind(b.name, np.asarray(np.asarray(consts[b.name]).astype(np_dtype(b.dtype)).reshape(-1), order="C"))
            elif b.name not in interface:
                self._bind(b.name, np.empty(b.size, np_dtype(b.dtype)))
        self._reused: dict[str, np.ndarray] = {}
        spec = lambda n: (n, self._slot.get(n), np_dtype(g.buffer(n).dtype), g.buffer(n).size)
        self._inputs = [spec(n) for n in g.inputs]     # (name, argument slot or None, dtype, elements)
        self._outputs = [spec(n) for n in g.outputs]

    @property
    def bound(self) -> dict[str, np.ndarray]:
        """The arrays the module holds itself (constants, scratch buffers), by GIR buffer."""
        return self._keep

    @property
    def entry_address(self) -> int:
        """The address of the entry point `void pf_run_<graph>(void **buffers)`."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def _bind(self, name: str, array: np.ndarray) -> None:
        self._keep[name] = array
        self._args[self._slot[name]] = array.ctypes.data

    def run(self, feeds: dict[str, np.ndarray], shapes: dict[str, tuple], fresh=frozenset()) -> dict[str, np.ndarray]:
        held = []   # arrays made here must outlive the call
        for name, slot, dtype, size in self._inputs:
            if slot is None or name not in feeds and name in self._keep:
                continue   # unused here, or a constant the graph holds
            a = feeds[name]
            if a.dtype != dtype or not a.flags.c_contiguous:
                a = np.asarray(a, dtype=dtype, order="C")
            if a.size < size:   # an empty tensor: the buffer still holds one element
                a = np.zeros(size, dtype)
            held.append(a)
            self._args[slot] = a.ctypes.data
        out = {}
        for name, slot, dtype, size in self._outputs:
            a = out[name] = self._output(name, shapes[name], dtype, name in fresh)
            if slot is not None:
                target = a if a.size >= size else np.empty(size, dtype)
                held.append(target)
                self._args[slot] = target.ctypes.data
        self._fn(self._args)
        return out

    def _output(self, name: str, shape: tuple, dtype: np.dtype, fresh: bool) -> np.ndarray:
        if fresh:
            return np.empty(shape, dtype)
        a = self._reused.get(name)
        if a is None or a.shape != tuple(shape):
            a = self._reused[name] = np.empty(shape, dtype)
        return a
