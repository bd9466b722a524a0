"""Where a whole model's GPU time goes: every kernel of one call, from torch.profiler (CUPTI),
sorted into categories, the same way for PowerFusion and for torch.

Categories (by kernel name; `categorize` is the one place that decides):
- library: GEMM / GEMV / convolution kernels of cuBLAS, cuDNN, CUTLASS and Inductor's GEMM templates,
  and our im2col kernel (it exists only to feed a GEMM);
- memory-bound: every other kernel (our generated kernels, Inductor's pointwise / reduction
  kernels, torch eager's elementwise and normalisation kernels);
- copies: memcpy / memset and pure layout copies (torch's copy kernels, cuDNN's NCHW <-> NHWC
  conversions);
- gaps: time inside the call's span with no kernel running (launch latency between kernels, or
  the host between graph pieces).

The call is profiled as it is timed: a captured CUDA graph replayed (CUPTI reports the kernels
inside graph launches), so gaps are what the device actually idles, not Python overhead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CATEGORIES = ("library", "memory-bound", "copies", "gaps")
_LIBRARY = ("gemm", "gemv", "xmma", "cutlass", "cublas", "sgemm", "hgemm", "implicit_convolve", "conv", "fprop",
            "triton_tem", "nvjet", "pf_im2col", "splitkreduce", "wgmma", "dot_kernel")
_OURS = re.compile(r"sg\d+_k\d+")
_COPIES = ("memcpy", "memset", "copy_kernel", "nchwtonhwc", "nhwctonchw", "direct_copy", "cat_array")


@dataclass(frozen=True, slots=True)
class KernelRecord:
    name: str
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def categorize(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):   # Inductor: GEMM templates are "triton_tem_*", the rest generated
        return "library" if low.startswith("triton_tem") else "memory-bound"
    if _OURS.fullmatch(name):   # ours: kernel k of subgraph N
        return "memory-bound"
    if any(k in low for k in _COPIES):
        return "copies"
    if any(k in low for k in _LIBRARY):
        return "library"
    return "memory-bound"


def profile_calls(run, calls: int = 3, synchronize=None) -> list[KernelRecord]:
    """GPU activity of `calls` back-to-back runs of `run()` (after one warm-up run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    sync = synchronize or torch.cuda.synchronize
    run()
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
        sync()
    records = []
    for e in prof.events():
        if getattr(e.device_type, "name", "") != "CUDA":
            continue
        records.append(KernelRecord(e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(records, key=lambda r: r.start_us)


def summarize(records: list[KernelRecord], calls: int) -> dict:
    """Per call: microseconds and kernel count by category, span, and the top kernels by time."""
    by_cat = {c: {"us": 0.0, "kernels": 0} for c in CATEGORIES}
    by_name: dict[str, list[float]] = {}
    for r in records:
        cat = by_cat[categorize(r.name)]
        cat["us"] += r.us / calls
        cat["kernels"] += 1
        by_name.setdefault(r.name, []).append(r.us)
    for c in CATEGORIES:
        by_cat[c]["kernels"] = round(by_cat[c]["kernels"] / calls, 1)
    span, busy = _span_and_busy(records)
    by_cat["gaps"]["us"] = max(0.0, span - busy) / calls
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))

    def rows(items):
        return [{"name": n[:120], "category": categorize(n), "us_per_call": sum(t) / calls,
                 "launches_per_call": len(t) / calls} for n, t in items]

    # the memory-bound kernels on their own as well: where a fused model loses, they say which
    memory = [kv for kv in ranked if categorize(kv[0]) == "memory-bound"][:20]
    return {"span_us": span / calls, "categories": by_cat, "top": rows(ranked[:12]), "top_memory_bound": rows(memory)}


def _span_and_busy(records: list[KernelRecord]) -> tuple[float, float]:
    if not records:
        return 0.0, 0.0
    busy, cur_start, cur_end = 0.0, records[0].start_us, records[0].end_us
    for r in records[1:]:
        if r.start_us > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = r.start_us, r.end_us
        else:
            cur_end = max(cur_end, r.end_us)
    busy += cur_end - cur_start
    return records[-1].end_us - records[0].start_us, busy


def markdown(title: str, meta: dict, profiles: dict[str, dict[str, dict]]) -> str:
    """profiles: case -> impl -> summarize() output."""
    lines = [f"# {title}", "", f"{meta.get('device', '?')}, {meta.get('date', '?')}, commit {meta.get('git_commit', '?')}. "
             "Microseconds per call (kernels per call) by category, from torch.profiler over CUDA-graph "
             "replays; `benchmarks/kernel_profile.py` says what each category holds.", "",
             "| case | impl | span us | library | memory-bound | copies | gaps |", "|---|---|---:|---:|---:|---:|---:|"]
    for case, impls in profiles.items():
        for impl, s in impls.items():
            if "error" in s:
                lines.append(f"| {case} | {impl} | - | {s['error'][:120]} | | | |")
                continue
            c = s["categories"]
            cells = [f"{c[k]['us']:.0f} ({c[k]['kernels']:g})" for k in CATEGORIES[:3]] + [f"{c['gaps']['us']:.0f}"]
            lines.append(f"| {case} | {impl} | {s['span_us']:.0f} | " + " | ".join(cells) + " |")
    if meta.get("findings"):
        lines += ["", "What it shows:", ""] + [f"- {f}" for f in meta["findings"]]
    for case, impls in profiles.items():
        for impl, s in impls.items():
            if "top" not in s:
                continue
            lines += ["", f"## {case}, {impl}: top kernels", "", "| kernel | category | us per call | launches |",
                      "|---|---|---:|---:|"]
            lines += [f"| `{t['name']}` | {t['category']} | {t['us_per_call']:.1f} | {t['launches_per_call']:g} |"
                      for t in s["top"]]
            if s.get("top_memory_bound"):
                lines += ["", f"{case}, {impl}: top memory-bound kernels", "", "| kernel | us per call | launches |",
                          "|---|---:|---:|"]
                lines += [f"| `{t['name']}` | {t['us_per_call']:.1f} | {t['launches_per_call']:g} |"
                          for t in s["top_memory_bound"]]
    return "\n".join(lines) + "\n"
