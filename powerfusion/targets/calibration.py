"""Measured figures of a lent GPU replacing datasheet ones in its TargetSpec.

benchmarks/calibrate.py measures them (copy bandwidth, bandwidth vs resident warps, kernel
launch cost in a CUDA graph, __syncthreads cost, shared-memory and L2 bandwidth) and writes
a JSON file; a copy of it lives next to this module as calibrated/<target key>.json, and
`get_target` applies it. Only perf-model fields change (achievable bandwidth, latency,
launch and sync costs, shared and cache bandwidth): the datasheet bandwidth and peak rates
stay, so the partition's ridge points do not move with a calibration.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from powerfusion.targets.target_spec import LevelSpec, MemorySystem, TargetSpec

HERE = Path(__file__).resolve().parent / "calibrated"
KEYS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("MI250", "mi250"), ("MI100", "mi100"))


def target_key(device_name: str) -> str | None:
    """Our target key for a device name as the driver reports it ('NVIDIA H100 80GB HBM3' -> 'h100')."""
    for token, key in KEYS:
        if token in device_name.upper():
            return key
    return None


def load_calibration(key: str | None = None) -> dict | None:
    """The stored calibration for a target key (or the first one stored when key is None)."""
    files = sorted(HERE.glob("*.json")) if key is None else [HERE / f"{key}.json"]
    for f in files:
        if f.exists():
            return json.loads(f.read_text())
    return None


def apply_calibration(t: TargetSpec, cal: dict) -> TargetSpec:
    mem = t.memory or MemorySystem(1e-6, 0, t.bandwidth)
    # the first calibration's copy loops let the compiler unroll (uncontrolled loads in
    # flight), so its latency fit is not used; later ones pin one load in flight per lane
    fit = cal.get("latency_fit", {}) if cal.get("ilp_controlled") else {}
    sms = cal.get("sms", t.groups_concurrent)
    curve = tuple((float(p["warps_per_sm"]), p["bandwidth"] / sms) for p in cal.get("bw_vs_warps", ())
                  if p.get("ilp", 1) == 1)
    # uncontrolled (first calibration): nvcc unrolled the "one load" copy loop, by 4 by default
    curve_ilp = 1.0 if cal.get("ilp_controlled") else 4.0
    mem = replace(mem, achievable=min(1.0, cal["copy_bandwidth"] / t.bandwidth),
                  latency_s=fit.get("latency_s", mem.latency_s),
                  cache_bandwidth=cal.get("l2_bandwidth", mem.cache_bandwidth),
                  cache_bytes=cal.get("l2_bytes", mem.cache_bytes),
                  bw_curve=curve or mem.bw_curve, curve_ilp=curve_ilp if curve else mem.curve_ilp,
                  scatter_read=cal.get("scatter_read_bandwidth", mem.scatter_read),
                  scatter_write=cal.get("scatter_write_bandwidth", mem.scatter_write),
                  kernel_floor_s=max(0.0, cal["tiny_kernel_s"] - cal.get("launch_s", t.launch_s))
                  if "tiny_kernel_s" in cal else mem.kernel_floor_s)
    levels = dict(t.levels)
    if "shared_bandwidth" in cal:
        levels["shared"] = LevelSpec(cal["shared_bandwidth"], levels["shared"].capacity)
    sync = dict(t.sync_s)
    sync["block"] = cal.get("block_sync_s", sync.get("block", 0.0))
    sync["device"] = cal.get("launch_s", t.launch_s)
    return replace(t, memory=mem, levels=levels, sync_s=sync, launch_s=cal.get("launch_s", t.launch_s),
                   calibrated=f"{cal.get('device', '?')} ({cal.get('date', '?')})")
