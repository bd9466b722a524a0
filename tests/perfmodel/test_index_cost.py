"""The perf model's index-arithmetic term (perfmodel/index_cost.py): per-element // and % of a
composed move's address cost issue time, so a channel shuffle's plane copy with a contiguous,
vectorised inner index ranks above the same copy addressed element by element through div/mod
chains (on the H200 the latter ran 66 us, 0.33 of the copy floor, where the model had ranked both
within 4%)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from powerfusion.gir.expr import I, J, U
from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Move, Parallel
from powerfusion.perfmodel.cost import estimate, predict_seconds
from powerfusion.perfmodel.index_cost import DIVMOD_OPS, slice_index_ops
from powerfusion.targets.specs import get_target

H200 = get_target("h200")
F32 = "float32"
X = I * 128 + J                      # the element's offset in its 28x28 plane (7 rows of 128)
N, C, HW = 64, 116, 784


def _slice(buf, index, valid=None, vec=4):
    return MemorySlice(buf, Level.GLOBAL, index, 7, 128, F32, vec, valid)


def composed_source():
    """a -> y1 of the shuffle as compose_split leaves it unrefitted (the kernel that ran 66 us)."""
    index = (U // C) * (C * HW) + (X % HW) % 128 + ((X % HW) // 128) * 128 + (((U % C) + X // HW) // 2) * HW
    return _slice("a", index, X.lt(HW) & ((U * HW + X) % (2 * HW)).lt(HW))


def plane_source():
    """The same elements after the refit: a contiguous plane behind a unit-only offset."""
    return _slice("a", ((U // 2) % 58) * HW + (U // C) * (C * HW) + X, X.lt(HW))


def test_div_mod_of_the_element_is_counted_and_the_units_part_is_not():
    plain = _slice("y", U * HW + X, X.lt(HW), vec=1)
    per_unit = _slice("y", (U % C) * HW + (U // C) * 90944 + X, X.lt(HW), vec=1)
    assert slice_index_ops(per_unit, 1) == slice_index_ops(plain, 1)     # u % 116, u // 116: once per unit
    by_element = _slice("y", U * HW + X % 100, X.lt(HW), vec=1)
    assert slice_index_ops(by_element, 1) >= slice_index_ops(plain, 1) + DIVMOD_OPS - 1


def test_a_vector_access_computes_its_index_once_per_vector():
    s = composed_source()
    assert slice_index_ops(s, 4) < slice_index_ops(s, 1)


def test_shared_subexpressions_are_counted_once():
    x = X % 300
    once = _slice("y", x, None, vec=1)
    twice = _slice("y", x + x * 3, None, vec=1)
    assert slice_index_ops(twice, 1) <= slice_index_ops(once, 1) + 2


def _shuffle_move(src: MemorySlice, guard=None) -> GIRGraph:
    dst = _slice("y1", U * HW + X, X.lt(HW))
    bufs = (Buffer("a", Level.GLOBAL, N * C * HW, F32), Buffer("y1", Level.GLOBAL, N * C * HW, F32))
    return GIRGraph("g", Parallel(N * C, 4, 32), bufs, (GOp(Move(), (src,), (dst,), guard),), ("a",), ("y1",))


def test_plane_copy_ranks_above_the_div_mod_copy_of_the_same_elements():
    even = ((U % 2) * 116).lt(1)
    slow = predict_seconds(estimate(_shuffle_move(composed_source()), H200), H200)
    fast = predict_seconds(estimate(_shuffle_move(plane_source(), even), H200), H200)
    assert fast * 1.3 < slow
    assert "index arithmetic" in estimate(_shuffle_move(composed_source()), H200).limits


def test_the_shuffles_search_picks_a_vectorised_plane_copy():
    """The shuffle's plan space built on the CPU (batch 4: 363K elements per output, past the split
    rule's sample): the pick is one kernel whose global moves are contiguous in j with no div/mod
    per element, and the plans ranked behind it are the ones that pay index arithmetic or traffic."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import perfmodel_accuracy as pa
    from powerfusion.frontend import import_model, partition_graph
    from powerfusion.gir.expr import affine_coefficient
    from powerfusion.pipeline.search import choose_plan
    graph = import_model(pa.channel_shuffle(116, 28, 28, N=4))
    sub = partition_graph(graph, "cuda").subgraphs[0]
    ch = choose_plan(sub, graph, "cuda", cache=False)
    assert len(ch.graph.kernels()) == 1
    moves = [op for op in ch.graph.ops if op.inputs and op.outputs and op.inputs[0].level == Level.GLOBAL
             and op.outputs[0].level == Level.GLOBAL]
    assert moves
    for op in moves:
        for s in op.inputs + op.outputs:
            assert affine_coefficient(s.index, "j") == 1, s.index
            assert slice_index_ops(s, s.vec) < DIVMOD_OPS, s
    assert [r.predicted_s for r in ch.top] == sorted(r.predicted_s for r in ch.top)
    assert np.isfinite(ch.predicted_s)


def test_parts_seen_through_j_over_the_lane_vector_are_counted_once_per_vector():
    """A depthwise strip over the flat output tests its row and column masks on j // 4 (the
    lane's first output): the same for the lane's 4 elements, computed once (nvcc knows
    j = 4 * lane + v); a mask on j itself stays per element."""
    f0 = U * 128 + (J // 4) * 4
    lane_mask = _slice("x", U * 128 + J, ((f0 // 56) % 56).ge(1) & (f0 % 56).ge(1), vec=4)
    elem_mask = _slice("x", U * 128 + J, (((U * 128 + J) // 56) % 56).ge(1) & ((U * 128 + J) % 56).ge(1), vec=4)
    assert slice_index_ops(lane_mask, 4, 4) * 3 < slice_index_ops(lane_mask, 4, 1)
    assert slice_index_ops(elem_mask, 4, 4) == slice_index_ops(elem_mask, 4, 1)
    from powerfusion.perfmodel.index_cost import lane_uniform
    assert lane_uniform(((U * 32 + J // 4) // 784) % 144, 4) and not lane_uniform((U * 128 + J) // 3136, 4)
