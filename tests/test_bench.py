"""`powerfusion bench`: percentiles, profile, JSON and a Chrome trace, on the CPU (and CUDA)."""
from __future__ import annotations

import json

import pytest

from powerfusion.cli import main
from tests.session_cases import SMALL

MODEL = str(SMALL / "sardrn_small.onnx")


def _bench(tmp_path, *extra):
    out, trace = tmp_path / "bench.json", tmp_path / "trace.json"
    rc = main(["-q", "bench", MODEL, "--warmup", "0", "--iterations", "3", "--duration", "0", "--profile",
               "--export-json", str(out), "--export-trace", str(trace), *extra])
    assert rc == 0
    return json.loads(out.read_text()), json.loads(trace.read_text())


def _check(doc, trace, steps_expected: int):
    for clock in ("latency", "device_time"):
        s = doc[clock]
        assert s["count"] >= 3
        assert s["min_ms"] <= s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert doc["throughput_per_s"] == pytest.approx(1e3 / doc["device_time"]["mean_ms"])
    rows = doc["profile"]
    assert len(rows) == steps_expected
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert all(r["bytes"] > 0 and r["ms"] > 0 and r["copy_fraction"] > 0 for r in rows)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {0, 1}          # runs and profiled steps
    assert all(e["dur"] >= 0 and "ts" in e for e in events)


def test_bench_cpu(tmp_path, capsys):
    doc, trace = _bench(tmp_path)
    printed = capsys.readouterr().out
    assert "p99" in printed and "of copy bw" in printed
    assert doc["target"] == "cpu" and doc["device"] == "cpu"
    _check(doc, trace, steps_expected=14)   # 7 convolutions, 7 memory-bound subgraphs


def test_bench_refuses_bad_counts(capsys):
    assert main(["bench", MODEL, "--iterations", "0"]) == 2
    assert "--iterations" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_cuda(tmp_path):
    doc, trace = _bench(tmp_path, "--target", "cuda")
    assert doc["target"] == "cuda" and doc["device"] != "cpu"
    assert doc["device_time"]["mean_ms"] <= doc["latency"]["mean_ms"]
    _check(doc, trace, steps_expected=14)
