"""Buffer planner: simultaneously live tensors never overlap; offsets aligned; space is reused."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from powerfusion.runtime.buffers import ALIGNMENT, TensorLife, plan_buffers


def _check(tensors, plan):
    for t in tensors:
        assert plan.offsets[t.name] % plan.alignment == 0
        assert plan.offsets[t.name] + t.size <= plan.arena_bytes
    for i, a in enumerate(tensors):
        for b in tensors[i + 1:]:
            if a.overlaps(b) and a.size and b.size:
                a0, b0 = plan.offsets[a.name], plan.offsets[b.name]
                assert a0 + a.size <= b0 or b0 + b.size <= a0, (a, b, plan)


def test_chain_reuses_memory():
    # x0 -> x1 -> x2 -> x3: each tensor is live for two steps, so two slots suffice
    tensors = [TensorLife(f"x{i}", 1000, i, i + 1) for i in range(4)]
    plan = plan_buffers(tensors)
    _check(tensors, plan)
    assert plan.arena_bytes == 2 * 1024
    assert plan.offsets["x0"] == plan.offsets["x2"]


def test_best_fit_picks_the_smallest_gap():
    tensors = [TensorLife("big", 4096, 0, 3), TensorLife("mid", 1024, 0, 0), TensorLife("top", 1024, 0, 3),
               TensorLife("small", 512, 1, 2)]
    plan = plan_buffers(tensors)
    _check(tensors, plan)
    # "mid" died at step 0, leaving a 1024-byte hole between "big" and "top"
    assert plan.offsets["small"] == plan.offsets["mid"]
    assert plan.arena_bytes == 4096 + 1024 + 1024


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="live range"):
        plan_buffers([TensorLife("t", 10, 3, 1)])
    with pytest.raises(ValueError, match="twice"):
        plan_buffers([TensorLife("t", 10, 0, 1), TensorLife("t", 10, 2, 3)])
    with pytest.raises(ValueError, match="power of two"):
        plan_buffers([TensorLife("t", 10, 0, 1)], alignment=100)


def test_empty_plan():
    plan = plan_buffers([])
    assert plan.arena_bytes == 0 and plan.offsets == {}


tensor_sets = st.lists(
    st.tuples(st.integers(0, 100_000), st.integers(0, 30), st.integers(0, 10)),
    min_size=1, max_size=40,
).map(lambda rows: [TensorLife(f"t{i}", size, first, first + span) for i, (size, first, span) in enumerate(rows)])


@settings(max_examples=200, deadline=None)
@given(tensor_sets)
def test_random_plans_are_valid_and_within_bounds(tensors):
    plan = plan_buffers(tensors)
    _check(tensors, plan)
    aligned = lambda n: -(-max(n, 1) // ALIGNMENT) * ALIGNMENT
    assert plan.peak_live_bytes(tensors) <= plan.arena_bytes <= sum(aligned(t.size) for t in tensors)
