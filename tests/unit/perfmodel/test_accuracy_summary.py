"""The accuracy benchmark's statistics (Spearman with ties, pick gaps) on known data."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "perfmodel_accuracy", Path(__file__).resolve().parents[3] / "benchmarks" / "perfmodel_accuracy.py")
acc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(acc)


def test_spearman_known_values():
    assert acc.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert acc.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: ranks (0.5, 0.5, 2, 3) vs (0, 1, 2, 3)
    assert acc.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


def test_summary_pick_and_top8_gaps():
    rows = [{"case": "a", "predicted_s": p, "measured_s": m} for p, m in [(1, 2.0), (2, 1.0), (3, 1.05), (4, 3.0)]]
    s = acc.summarise(rows)
    c = s["per_case"]["a"]
    assert c["pick_gap"] == pytest.approx(1.0)          # the model picked the 2.0 plan, best is 1.0
    assert c["top8_best_gap"] == pytest.approx(0.0)     # the best plan is among its top 8
    assert s["cases_pick_within_10pct"] == 0 and s["cases_top8_within_10pct"] == 1
