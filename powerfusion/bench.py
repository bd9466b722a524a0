"""Benchmark a session in trtexec's manner: warm up, run for at least N iterations and S
seconds, report latency percentiles, throughput and (optionally) a per-step profile.

Two clocks:
- end-to-end latency: wall time of `session.run` (host inputs in, host outputs out);
- device time: on CUDA, the replay of the captured CUDA graph between two CUDA events
  (inputs already on the device); on the CPU, the same wall time (there is no other device).
The profile runs the plan once more step by step (CUDA: eagerly, with events around every
library call and every subgraph's kernels; CPU: `session.profile`) and sets each step's
compulsory bytes against the copy bandwidth measured on the same device.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Stats:
    mean_ms: float
    min_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    count: int

    @staticmethod
    def of(seconds: list[float]) -> "Stats":
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return Stats(float(ms.mean()), float(ms.min()), float(p50), float(p90), float(p99), float(ms.max()), len(ms))


@dataclass(frozen=True)
class ProfileRow:
    name: str
    kind: str          # "subgraph" | "library"
    what: str          # op kinds of the step
    ms: float
    share: float       # of the profiled total
    bytes: int         # compulsory bytes (inputs read once, outputs written once)
    copy_fraction: float   # (bytes / time) / measured copy bandwidth


@dataclass
class BenchResult:
    model: str
    target: str
    device: str
    latency: Stats                       # end-to-end, wall
    device_time: Stats                   # CUDA graph replay (cuda) / wall (cpu)
    throughput_per_s: float              # inferences per second of device time
    warmup_s: float
    duration_s: float
    copy_bandwidth_gbs: float | None = None
    profile: list[ProfileRow] = field(default_factory=list)
    trace_events: list[dict] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc.pop("trace_events")
        return doc


@dataclass(frozen=True)
class BenchSettings:
    warmup_s: float = 0.2
    iterations: int = 10        # at least this many timed runs...
    duration_s: float = 3.0     # ...and at least this long
    profile: bool = False


def run_bench(session, feeds: dict, settings: BenchSettings, model: str = "") -> BenchResult:
    cuda = session.get_providers()[0].startswith("CUDA")
    warm_start = time.perf_counter()
    while True:   # at least one run: it compiles kernels and captures the graph
        session.run(None, feeds)
        if time.perf_counter() - warm_start >= settings.warmup_s:
            break
    warmup = time.perf_counter() - warm_start
    wall, events, start = _timed_runs(lambda: session.run(None, feeds), settings)
    if cuda:
        device, device_name = _device_times(session, feeds, settings), _cuda_device_name()
    else:
        device, device_name = wall, "cpu"
    result = BenchResult(model, session.target, device_name, Stats.of(wall), Stats.of(device),
                         1.0 / float(np.mean(device)), warmup, time.perf_counter() - start,
                         trace_events=events)
    if settings.profile:
        rows, step_events = (_profile_cuda if cuda else _profile_cpu)(session, feeds)
        result.profile = rows
        result.copy_bandwidth_gbs = _copy_bandwidth(cuda) / 1e9
        result.profile = [_with_bandwidth(r, result.copy_bandwidth_gbs * 1e9) for r in rows]
        result.trace_events += step_events
    return result


def _timed_runs(call, settings: BenchSettings):
    times, events = [], []
    start = time.perf_counter()
    while len(times) < settings.iterations or time.perf_counter() - start < settings.duration_s:
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if len(events) < 2000:   # a trace of the first 2000 runs keeps the file small
            events.append(_event(f"run {len(times)}", "run", t0 - start, t1 - t0, tid=0))
    return times, events, start


def _event(name: str, cat: str, start_s: float, dur_s: float, tid: int, args=None) -> dict:
    """A Chrome trace "complete" event (Perfetto and chrome://tracing read these)."""
    return {"name": name, "cat": cat, "ph": "X", "ts": round(start_s * 1e6, 3), "dur": round(dur_s * 1e6, 3),
            "pid": 1, "tid": tid, "args": args or {}}


def trace_document(result: BenchResult) -> dict:
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "runs (wall)"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "profiled steps"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"powerfusion {result.target}"}}]
    return {"traceEvents": meta + result.trace_events, "displayTimeUnit": "ms"}


# ---- CUDA ---------------------------------------------------------------------------

def _device_times(session, feeds: dict, settings: BenchSettings) -> list[float]:
    """Graph replays timed with CUDA events (inputs uploaded once)."""
    import cupy
    runner = session._executor
    if not runner.use_cuda_graph:
        raise ValueError("device time needs a session made with options={'cuda_graph': True}")
    with cupy.cuda.Device(runner.device_id):
        runner.run_device(feeds)                      # captured; inputs in the arena
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times, t0 = [], time.perf_counter()
        while len(times) < settings.iterations or time.perf_counter() - t0 < settings.duration_s:
            start.record()
            runner._replay()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return times


def _profile_cuda(session, feeds: dict):
    """Each step once more, eagerly, between CUDA events (after one eager warm-up pass)."""
    import cupy
    runner = session._executor
    rows, events = [], []
    with cupy.cuda.Device(runner.device_id):
        runner._load_inputs(feeds)
        runner._run_steps()
        runner._load_inputs(feeds)
        at = 0.0
        for s in runner.plan.steps:
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            runner._run_steps([s])
            stop.record()
            stop.synchronize()
            secs = cupy.cuda.get_elapsed_time(start, stop) / 1e3
            rows.append(_row(s.name, _step_of(s), secs))
            events.append(_event(s.name, rows[-1].kind, at, secs, tid=1, args={"bytes": rows[-1].bytes}))
            at += secs
    return _shares(rows), events


def _step_of(s):
    return getattr(s, "subgraph", None) or s.call


def _cuda_device_name() -> str:
    from powerfusion.backends.cuda.runtime import device_info
    return device_info().name


# ---- CPU ----------------------------------------------------------------------------

def _profile_cpu(session, feeds: dict):
    session.run(None, feeds)
    from powerfusion.basic import Subgraph
    steps = {(s.name if isinstance(s, Subgraph) else s.node.name): s for s in session.partition.steps}
    rows, events, at = [], [], 0.0
    for name, secs in session.profile:
        rows.append(_row(name, steps[name], secs))
        events.append(_event(name, rows[-1].kind, at, secs, tid=1, args={"bytes": rows[-1].bytes}))
        at += secs
    return _shares(rows), events


# ---- shared -------------------------------------------------------------------------

def _row(name: str, step, secs: float) -> ProfileRow:
    """step: a partition Subgraph or LibraryCall."""
    if hasattr(step, "nodes"):
        kinds = sorted({type(n.op).__name__ for n in step.nodes})
        what = f"{len(step.nodes)} ops: " + ", ".join(kinds)
        return ProfileRow(name, "subgraph", what, secs * 1e3, 0.0, int(step.bytes), 0.0)
    return ProfileRow(name, "library", type(step.node.op).__name__, secs * 1e3, 0.0, int(step.bytes), 0.0)


def _shares(rows: list[ProfileRow]) -> list[ProfileRow]:
    total = sum(r.ms for r in rows) or 1.0
    return [ProfileRow(r.name, r.kind, r.what, r.ms, r.ms / total, r.bytes, r.copy_fraction) for r in rows]


def _with_bandwidth(r: ProfileRow, copy_bps: float) -> ProfileRow:
    achieved = r.bytes / (r.ms / 1e3) if r.ms > 0 else 0.0
    return ProfileRow(r.name, r.kind, r.what, r.ms, r.share, r.bytes, achieved / copy_bps if copy_bps else 0.0)


def _copy_bandwidth(cuda: bool, nbytes: int = 256 << 20) -> float:
    """Bytes moved (read + written) per second by a plain copy of `nbytes`; best of 5."""
    if cuda:
        import cupy
        src, dst = cupy.empty(nbytes // 4, np.float32), cupy.empty(nbytes // 4, np.float32)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        best = float("inf")
        for _ in range(5):
            start.record()
            cupy.copyto(dst, src)
            stop.record()
            stop.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return 2 * nbytes / best
    nbytes = 64 << 20   # the host: 64 MB, past the last-level cache
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def format_report(r: BenchResult) -> str:
    lines = [f"{r.model} on {r.target} ({r.device}): {r.latency.count} runs in {r.duration_s:.2f} s "
             f"after {r.warmup_s:.2f} s of warm-up",
             f"  {'':<22}{'mean':>10}{'min':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}  (ms)"]
    for label, s in (("latency (end to end)", r.latency),
                     ("device time" + (" (graph)" if r.target != "cpu" else " (wall)"), r.device_time)):
        lines.append(f"  {label:<22}{s.mean_ms:>10.4f}{s.min_ms:>10.4f}{s.p50_ms:>10.4f}{s.p90_ms:>10.4f}"
                     f"{s.p99_ms:>10.4f}{s.max_ms:>10.4f}")
    lines.append(f"  throughput: {r.throughput_per_s:.1f} inferences/s (device time)")
    if r.profile:
        lines.append(f"  profile (one run, step by step; copy bandwidth {r.copy_bandwidth_gbs:.1f} GB/s):")
        lines.append(f"  {'step':<28}{'kind':<10}{'ms':>10}{'share':>8}{'bytes':>14}{'of copy bw':>11}  what")
        for p in sorted(r.profile, key=lambda p: -p.ms):
            lines.append(f"  {p.name:<28}{p.kind:<10}{p.ms:>10.4f}{p.share:>8.1%}{p.bytes:>14,}"
                         f"{p.copy_fraction:>11.3f}  {p.what}")
    return "\n".join(lines)


def write_json(result: BenchResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=1)


def write_trace(result: BenchResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace_document(result), f)
