"""Framework baselines for a function written as torch code: eager, and
`torch.compile(fn, dynamic=False)` in the default mode (Inductor, no CUDA graphs of its own).
Each baseline becomes benchmark rows in the shared format (harness.ROW_FIELDS)."""
from __future__ import annotations

import time
from typing import Callable

from harness import count_torch_kernels, input_sets_needed, time_torch


def torch_impls(fn: Callable) -> dict[str, Callable]:
    import torch
    # Dynamo keys its cache by code object and silently falls back to eager after
    # `recompile_limit` shapes of one function; a fresh cache and a high limit prevent that
    # (rows record `compiled_graphs` so a fallback would show).
    torch._dynamo.reset()
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    return {"torch-eager": fn, "torch-compile": torch.compile(fn, dynamic=False)}


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def bench_torch(case: str, dtype: str, shape: tuple, impls: dict[str, Callable],
                make_args: Callable[[], tuple], bytes_moved: int, copy_bw: float, l2: int,
                bytes_per_set: int) -> list[dict]:
    """One row per impl: timings over rotated input sets, kernel count, and the largest
    difference from the first impl's output (a sanity check that the baselines agree)."""
    import torch
    sets = [make_args() for _ in range(input_sets_needed(bytes_per_set, l2))]
    rows, reference = [], None
    for impl, fn in impls.items():
        graphs_before, t0 = _graphs_compiled(), time.perf_counter()
        out = fn(*sets[0])           # first call: torch.compile compiles here
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        compiled_graphs = _graphs_compiled() - graphs_before
        outs = [o.float() for o in (out if isinstance(out, (tuple, list)) else (out,))]
        if reference is None:
            reference, diff = outs, 0.0
        else:
            diff = max(float((o - r).abs().max()) for o, r in zip(outs, reference))
        del out
        timing = time_torch(fn, sets)
        rows.append({"case": case, "dtype": dtype, "shape": list(shape), "impl": impl,
                     "device_time_s": timing.device_time_s, "latency_s": timing.latency_s,
                     "bytes": bytes_moved, "bw_fraction": bytes_moved / timing.device_time_s / copy_bw,
                     "kernels": count_torch_kernels(fn, sets[0]),
                     "timing_method": timing.method, "input_sets": timing.sets,
                     "first_call_s": first_call_s, "compiled_graphs": compiled_graphs, "max_abs_diff_vs_first_impl": diff})
        torch.cuda.empty_cache()
    return rows
