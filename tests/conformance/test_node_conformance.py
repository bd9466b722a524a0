"""ONNX node conformance through powerfusion.backend on the CPU (see node_cases.py for the rules).

Supported ops must give the case's numbers within its rtol/atol; unsupported ops must raise
UnsupportedOpError naming the op; exclusions are in filters.py, each with a reason.
"""
from __future__ import annotations

import pytest

from filters import excluded_reason
from node_cases import all_cases, run_case


@pytest.mark.parametrize("name", sorted(all_cases()))
def test_node_case(name):
    case = all_cases()[name]
    outcome = run_case(case)
    reason = excluded_reason(name, case.model)
    if reason:
        assert outcome.bug or outcome.status in ("unsupported", "opset"), \
            f"{name} is excluded in filters.py ({reason}) but now {outcome.status}: remove the entry"
        pytest.xfail(f"excluded: {reason} [{outcome.status}: {outcome.detail[:200]}]")
    assert not outcome.bug, f"{name}: {outcome.status}: {outcome.detail}"
