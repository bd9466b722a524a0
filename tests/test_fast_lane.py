"""The fast lane's list (tests/fast_lane.py) names files that exist, so a renamed or removed
test file cannot silently drop out of it or stay listed as not fast."""
from __future__ import annotations

from fast_lane import FAST_FILES, FAST_FOLDERS, NOT_FAST, TESTS, in_fast_lane, left_out


def test_every_listed_file_exists():
    missing = [f for f in (*FAST_FILES, *NOT_FAST) if not (TESTS / f).is_file()]
    assert not missing, f"tests/fast_lane.py lists files that do not exist: {missing}"


def test_every_fast_folder_keeps_tests_in_the_lane():
    empty = [d for d in FAST_FOLDERS if not any(in_fast_lane(p) for p in (TESTS / d).glob("test_*.py"))]
    assert not empty, f"fast folders with no test file in the lane: {empty}"


def test_lane_leaves_out_what_it_lists_and_keeps_helpers():
    assert left_out(TESTS / "frontend" / "test_light_models.py")
    assert not left_out(TESTS / "frontend" / "test_loader.py")
    assert left_out(TESTS / "conformance")
    assert not left_out(TESTS / "backends")   # it holds fast files
    assert not left_out(TESTS / "backends" / "gir_cases.py")   # a helper module, imported by tests
