"""Stored calibrations replace perf-model figures only (the partition's ridge points stay)."""
from __future__ import annotations

import json

import pytest

from powerfusion.targets.calibration import HERE, apply_calibration, target_key
from powerfusion.perfmodel.cost import _per_sm_bandwidth
from powerfusion.targets.specs import get_target, targets


def test_device_names_map_to_targets():
    assert target_key("NVIDIA H200") == "h200"
    assert target_key("NVIDIA H100 80GB HBM3") == "h100"
    assert target_key("NVIDIA A100-PCIE-40GB") == "a100"
    assert target_key("Some Other GPU") is None


@pytest.mark.parametrize("path", sorted(HERE.glob("*.json")), ids=lambda p: p.stem)
def test_stored_calibration_is_applied_by_get_target(path):
    cal = json.loads(path.read_text())
    t = get_target(path.stem)
    base = targets()[path.stem]
    assert t.calibrated and cal["device"] in t.calibrated
    assert t.launch_s == pytest.approx(cal["launch_s"])
    assert t.memory.achievable * t.bandwidth == pytest.approx(cal["copy_bandwidth"])
    assert t.ridge_point() == base.ridge_point() and t.peak_flops == base.peak_flops
    # the measured curve is what the model reads back, per SM
    w, bw = t.memory.bw_curve[2]
    assert _per_sm_bandwidth(t, w) == pytest.approx(bw)
    assert bw * cal["sms"] == pytest.approx(cal["bw_vs_warps"][2]["bandwidth"])


def test_first_calibration_format_is_read_as_unrolled():
    cal = {"device": "X", "copy_bandwidth": 3e12, "launch_s": 1e-6, "sms": 132,
           "bw_vs_warps": [{"warps_per_sm": 1, "ilp": 1, "bandwidth": 1e12}], "latency_fit": {"latency_s": 1e-7}}
    t = apply_calibration(targets()["h100"], cal)
    assert t.memory.curve_ilp == 4.0                                  # nvcc unrolled the copy loop
    assert t.memory.latency_s == targets()["h100"].memory.latency_s     # so its latency fit is ignored
    t2 = apply_calibration(targets()["h100"], {**cal, "ilp_controlled": True})
    assert t2.memory.curve_ilp == 1.0 and t2.memory.latency_s == 1e-7
