"""Timing GIR graphs on the CUDA device (the `tune=True` search and the accuracy benchmark).

Device time per call: the graph's kernels are captured once into a CUDA graph (no launch
overhead, no host gaps) and replayed; CUDA events around the replays, divided by the
calls. Inputs are rotated among enough sets to exceed twice the L2, so reads come from
DRAM as they would inside a model. CuPy is imported here only.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np

from powerfusion.gir.interpreter import np_dtype
from powerfusion.gir.ir import GIRGraph

TARGET_S = 0.02       # GPU time per measurement
MAX_SETS = 64


def random_inputs(graph: GIRGraph, seed: int = 0) -> dict:
    """Host arrays for the graph's GLOBAL inputs (integer inputs stay small: gather indices)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in graph.inputs:
        b = graph.buffer(name)
        dt = np_dtype(b.dtype)
        if np.dtype(dt).kind in "iu":
            out[name] = rng.integers(0, 2, b.size).astype(dt)
        elif np.dtype(dt).kind == "b":
            out[name] = rng.random(b.size) < 0.5
        else:
            out[name] = rng.standard_normal(b.size).astype(np.float32).astype(dt)
    return out


def time_graph(graph: GIRGraph, executor=None, repeats: int = 3) -> float:
    """Seconds per call on the current CUDA device (median of `repeats` measurements)."""
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor, device_dtype
    ex = executor or GIRExecutor(graph)
    host = random_inputs(graph)
    set_bytes = sum(graph.buffer(n).size * np.dtype(np_dtype(graph.buffer(n).dtype)).itemsize
                    for n in graph.inputs + graph.outputs)
    l2 = cupy.cuda.Device().attributes.get("L2CacheSize", 50 << 20)
    sets = max(1, min(MAX_SETS, math.ceil(2 * l2 / max(set_bytes, 1))))
    arrays = []
    for _ in range(sets):
        # bf16 buffers live on the device as uint16 bit patterns (executor.device_dtype)
        a = {n: cupy.asarray(v.view(device_dtype(graph.buffer(n).dtype))) for n, v in host.items()}
        for n in graph.outputs:
            b = graph.buffer(n)
            a[n] = cupy.empty(b.size, dtype=device_dtype(b.dtype))
        arrays.append(a)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for a in arrays:
            ex(a, stream=stream)   # warm up: module load, first-touch
        stream.synchronize()
        stream.begin_capture()
        for a in arrays:
            ex(a, stream=stream)
        cgraph = stream.end_capture()
        cgraph.launch(stream)
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        cgraph.launch(stream)
        end.record(stream)
        end.synchronize()
        one = cupy.cuda.get_elapsed_time(start, end) / 1e3
        replays = max(1, min(2000, int(TARGET_S / max(one, 1e-7))))
        results = []
        for _ in range(repeats):
            start.record(stream)
            for _ in range(replays):
                cgraph.launch(stream)
            end.record(stream)
            end.synchronize()
            results.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / (replays * sets))
    return float(np.median(results))


def time_graphs(graphs: list[GIRGraph]) -> list[float]:
    """Device seconds per call of each graph; a graph that fails to compile or launch gets inf.
    Processes tuning at the same time (parallel compiles) take turns on the device, so that
    none times its plans while another's kernels share the GPU."""
    out = []
    with _device_turn():
        for g in graphs:
            try:
                out.append(time_graph(g))
            except Exception:  # compile/launch failure of one candidate: it cannot be the pick
                out.append(math.inf)
    return out


@contextlib.contextmanager
def _device_turn():
    """An exclusive lock file under the cache directory (POSIX advisory lock; elsewhere none)."""
    try:
        import fcntl
    except ImportError:   # no fcntl (Windows): timings may overlap, as before
        yield
        return
    from powerfusion import options
    path = Path(options.current().cache_dir) / "tune.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
