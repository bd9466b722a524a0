"""Benchmark utilities shared by every benchmark (run on the GPU machine).

Two numbers per callable:
- device time: the calls are captured once into a CUDA graph and the graph is replayed;
  elapsed GPU time (events) / number of calls. No launch overhead, no host gaps.
- latency: wall time of one call followed by a synchronize, as a user of the Python API
  feels it (median over calls).
Both defeat the L2 cache by rotating among enough input sets that together they exceed
twice the L2 size (one set when one set alone is that large), so every call reads DRAM.

Bandwidth figures are (bytes read + bytes written) / time; the reference is a measured
device-to-device copy, so `bw_fraction` says how close a kernel gets to what the memory
system actually delivers (not to the datasheet number).

    python3 benchmarks/harness.py probe     # JSON facts about CuPy / NVRTC / cuBLAS here
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROW_FIELDS = ("case", "dtype", "shape", "impl", "device_time_s", "latency_s", "bytes", "bw_fraction", "kernels")
TARGET_TIMED_S = 0.05   # GPU time per measurement; replays are chosen to reach it


@dataclass(frozen=True, slots=True)
class Timing:
    device_time_s: float     # per call, from graph replay (or events around launches)
    latency_s: float         # per call, wall, median
    method: str              # "cuda-graph" | "events"
    sets: int                # input sets rotated through
    replays: int


def input_sets_needed(bytes_per_set: int, l2_bytes: int, cap: int = 64) -> int:
    """How many distinct input sets make one rotation exceed 2x L2."""
    return max(1, min(cap, math.ceil(2 * l2_bytes / max(bytes_per_set, 1))))


# ---- torch ------------------------------------------------------------------------------
def time_torch(fn: Callable, arg_sets: list[tuple], latency_calls: int = 50) -> Timing:
    """Device time by CUDA-graph replay of fn over every arg set, and per-call latency."""
    import torch
    for args in arg_sets:  # warm up (torch.compile compiles here) on a side stream, as graphs require
        _side_stream_call(fn, args)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for args in arg_sets:
                fn(*args)
        run, method = graph.replay, "cuda-graph"
    except Exception:  # not capturable (host syncs, dynamic allocations): time plain launches
        graph = None
        run, method = (lambda: [fn(*a) for a in arg_sets]), "events"
    per_replay, replays = _time_with_events(run, _torch_event, torch.cuda.synchronize)
    device_s = per_replay / len(arg_sets)
    del graph
    latency = _latency(lambda i: fn(*arg_sets[i % len(arg_sets)]), torch.cuda.synchronize, latency_calls)
    return Timing(device_s, latency, method, len(arg_sets), replays)


def _torch_event():
    import torch
    return torch.cuda.Event(enable_timing=True)


def _side_stream_call(fn, args):
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)


def count_torch_kernels(fn: Callable, args: tuple) -> int:
    """GPU kernels one call launches (memcpy / memset excluded), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA"
               and not e.name.startswith(("Memcpy", "Memset", "cudaMem"))]
    return len(kernels)


def torch_cuda_missing(bench: str) -> bool:
    """True, after saying why on stderr, when torch cannot reach a CUDA device."""
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:
        print(f"{bench} needs torch with a CUDA device ({e})", file=sys.stderr)
        return True
    return False


# ---- cupy -------------------------------------------------------------------------------
def time_cupy(fn: Callable, arg_sets: list[tuple], latency_calls: int = 50,
              bind: Callable | None = None) -> Timing:
    """As time_torch, for callables on CuPy arrays (stream capture into a cupy.cuda.Graph).
    `bind(stream)`, when given, points fn's library handles (cuBLAS, cuDNN) at the capture
    stream before the capture, and back at the current stream before the latency calls."""
    import cupy
    for args in arg_sets:
        fn(*args)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            if bind is not None:
                bind(stream)
            stream.begin_capture()
            try:
                for args in arg_sets:
                    fn(*args)
            finally:
                graph = stream.end_capture()
        graph.upload(stream)
        run, method = (lambda: graph.launch(stream)), "cuda-graph"
    except Exception:
        run, method = (lambda: [fn(*a) for a in arg_sets]), "events"
    with stream:
        per_replay, replays = _time_with_events(run, cupy.cuda.Event, stream.synchronize)
    if bind is not None:
        bind(cupy.cuda.get_current_stream())
    sync = cupy.cuda.Device().synchronize
    latency = _latency(lambda i: fn(*arg_sets[i % len(arg_sets)]), sync, latency_calls)
    return Timing(per_replay / len(arg_sets), latency, method, len(arg_sets), replays)


# ---- shared timing loops ----------------------------------------------------------------
def _time_with_events(run: Callable, make_event, synchronize) -> tuple[float, int]:
    """Seconds per `run()` from (timing-enabled) events around enough runs to fill TARGET_TIMED_S."""
    def measure(n):
        start, end = make_event(), make_event()
        start.record()
        for _ in range(n):
            run()
        end.record()
        end.synchronize()
        return _elapsed_ms(start, end) / 1e3 / n
    run()
    synchronize()
    one = measure(1)
    replays = max(3, min(1000, int(TARGET_TIMED_S / max(one, 1e-7))))
    return measure(replays), replays


def _elapsed_ms(start, end) -> float:
    if hasattr(start, "elapsed_time"):
        return start.elapsed_time(end)       # torch
    import cupy
    return cupy.cuda.get_elapsed_time(start, end)


def _latency(call: Callable[[int], object], synchronize, calls: int) -> float:
    samples, budget_end = [], time.perf_counter() + 4 * TARGET_TIMED_S
    for i in range(calls):
        t0 = time.perf_counter()
        call(i)
        synchronize()
        samples.append(time.perf_counter() - t0)
        if i >= 4 and time.perf_counter() > budget_end:
            break
    return statistics.median(samples)


# ---- device facts -----------------------------------------------------------------------
def l2_bytes() -> int:
    import torch
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (2 * nbytes per copy)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    per_copy, _ = _time_with_events(lambda: dst.copy_(src), _torch_event, torch.cuda.synchronize)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / per_copy


def probe() -> dict:
    """What this machine's CuPy can do: cuDNN, bf16 matmul, NVRTC version and targets."""
    import cupy
    import numpy as np
    from cupy.cuda import compiler
    facts = {"cupy": cupy.__version__, "nvrtc": list(cupy.cuda.nvrtc.getVersion()),
             "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
             "cupy.cudnn importable": _importable("cupy.cudnn"),
             "cupy.cuda.cudnn importable": _importable("cupy.cuda.cudnn"),
             "cupyx.cudnn importable": _importable("cupyx.cudnn")}
    try:
        import ml_dtypes
        a = cupy.asarray(np.ones((4, 4), dtype=ml_dtypes.bfloat16))
        facts["bf16 array"] = str(a.dtype)
        try:
            facts["bf16 matmul"] = f"ok: {float(cupy.matmul(a, a).astype(cupy.float32)[0, 0])}"
        except Exception as e:
            facts["bf16 matmul"] = f"fails: {type(e).__name__}: {e}"[:300]
    except Exception as e:
        facts["bf16 array"] = f"fails: {type(e).__name__}: {e}"[:300]
    src = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 1.0f; }'
    for arch in ("80", "90", "100", "120"):  # CuPy's arch argument is numeric
        try:
            binary, _ = compiler.compile_using_nvrtc(src, (), arch=arch, cache_in_memory=True)
            kind = "cubin" if bytes(binary[:4]) == b"\x7fELF" else "ptx"
            facts[f"nvrtc arch {arch}"] = f"ok ({len(binary)} bytes, {kind})"
        except Exception as e:
            facts[f"nvrtc arch {arch}"] = f"fails: {type(e).__name__}: {str(e)[:200]}"
    try:  # arch-specific targets (wgmma, setmaxnreg) need sm_90a, which only raw NVRTC options reach
        nvrtc = cupy.cuda.nvrtc
        prog = nvrtc.createProgram(src, "k.cu", [], [])
        nvrtc.compileProgram(prog, ["-arch=sm_90a"])
        facts["nvrtc -arch=sm_90a"] = f"ok ({len(nvrtc.getCUBIN(prog))} bytes cubin)"
        nvrtc.destroyProgram(prog)
    except Exception as e:
        facts["nvrtc -arch=sm_90a"] = f"fails: {type(e).__name__}: {str(e)[:200]}"
    try:
        from powerfusion.backends.cuda.runtime import device_info
        facts["device"] = asdict(device_info())
    except Exception as e:
        facts["device"] = f"fails: {type(e).__name__}: {e}"
    return facts


def _importable(module: str) -> bool:
    import importlib
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


# ---- results ----------------------------------------------------------------------------
def git_commit() -> str:
    # a copy of the tree (the GPU machine's) may carry a stale .git: the runner's word wins
    if os.environ.get("POWERFUSION_GIT_COMMIT"):
        return os.environ["POWERFUSION_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def run_metadata(**extra) -> dict:
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_commit": git_commit(), "python": sys.version.split()[0]}
    try:
        import torch
        meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    except Exception:
        pass
    meta.update(extra)
    return meta


def write_results(name: str, rows: list[dict], meta: dict, out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """benchmarks/results/<name>.json (meta + rows) and .md (a short table): one current file per
    suite; the date and commit are inside, superseded runs live in git history."""
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    stem = name
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md_path.write_text(markdown_table(name, rows, meta))
    return json_path, md_path


def markdown_table(name: str, rows: list[dict], meta: dict) -> str:
    head = [f"# {name}", "",
            f"{meta.get('device', '?')}, {meta['date']}, commit {meta['git_commit']}; "
            f"copy bandwidth {meta.get('copy_bandwidth_GBps', '?')} GB/s (read + write).", "",
            "| case | dtype | shape | impl | device us | latency us | GB/s | of copy bw | kernels |",
            "|---|---|---|---|---:|---:|---:|---:|---:|"]
    lines = []
    for r in rows:
        if r.get("device_time_s") is None:
            lines.append(f"| {r['case']} | {r['dtype']} | {r.get('shape', '-')} | {r['impl']} | - | - | - | - | "
                         f"{r.get('error', 'not run')} |")
            continue
        gbps = r["bytes"] / r["device_time_s"] / 1e9
        lines.append(f"| {r['case']} | {r['dtype']} | {'x'.join(map(str, r['shape']))} | {r['impl']} | "
                     f"{r['device_time_s'] * 1e6:.1f} | {r['latency_s'] * 1e6:.1f} | {gbps:.0f} | "
                     f"{r['bw_fraction']:.2f} | {r['kernels']} |")
    notes = [f"", *[f"- {n}" for n in meta.get("notes", [])]]
    return "\n".join(head + lines + notes) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        print(json.dumps(probe(), indent=1))
    else:
        sys.exit("usage: python3 benchmarks/harness.py probe")
