"""conv.depthwise.strip: numerics against numpy (float64), the loads it issues against the gather
template, and the in-lane register moves that build its windows.

Tolerances as tests/templates/test_stencil.py: float32 1e-5 / 1e-5, float16 2e-3 / 2e-3.
"""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.gir.ir import Level, Move
from powerfusion.templates import buffer_names, candidates
from tests.unit.templates.test_stencil import assert_candidates_match_numpy, case_of, conv_case

CASES = {   # id: (shape, k, stride, pads, dilation, multiplier, dtype); rows of 33..127 columns
    "3x3-56": ((2, 3, 6, 56), 3, (1, 1), None, (1, 1), 1, "float32"),
    "3x3-s2-uneven-pad": ((2, 2, 9, 70), 3, (2, 2), ((1, 0), (1, 1)), (1, 1), 1, "float32"),
    "5x5-dilated": ((1, 2, 9, 40), 5, (1, 1), ((4, 4), (4, 4)), (2, 2), 1, "float32"),
    "7x7-40": ((1, 2, 9, 40), 7, (1, 1), None, (1, 1), 1, "float32"),
    "3x3-no-padding": ((1, 2, 8, 66), 3, (1, 1), ((0, 0), (0, 0)), (1, 1), 1, "float32"),
    "3x3-multiplier-2-fp16": ((1, 2, 9, 40), 3, (1, 1), None, (1, 1), 2, "float16"),
    "7x7-fp16": ((1, 2, 10, 72), 7, (1, 1), None, (1, 1), 1, "float16"),
    "5x5-s2-fp16": ((1, 2, 11, 90), 5, (2, 2), ((2, 1), (1, 2)), (1, 1), 1, "float16"),
}


def strip_candidates(case, target="cuda"):
    g, _ = case
    node = g.graph.nodes[-1]
    return [c for c in candidates(node, g.graph.tensors, target, buffer_names(list(g.graph.tensors)))
            if c.name == "conv.depthwise.strip"]


@pytest.mark.parametrize("cid", list(CASES))
def test_strip_matches_numpy(cid):
    assert_candidates_match_numpy(cid, CASES[cid], strip_candidates)


def _global_loads(gir):
    return [op for op in gir.ops if isinstance(op.args, Move) and op.inputs[0].level == Level.GLOBAL
            and op.inputs[0].buffer == "x"]


def test_strip_loads_each_window_row_as_vector_chunks():
    """Expected form of a 3x3 conv over 56-wide rows, vec 4: per window row three 4-wide chunks
    (the lane's own and one each side) -- 9 vector loads of x per lane and 4 outputs, where cols
    loads the 36 window elements one by one -- and the window built by register moves only."""
    case, _ = case_of(CASES["3x3-56"])
    strip = next(c for c in strip_candidates(case) if c.params.vec == 4).build()
    loads = _global_loads(strip)
    assert len(loads) == 9 and all(op.inputs[0].vec == 4 and op.inputs[0].count == 128 for op in loads)
    inlane = [op for op in strip.ops if isinstance(op.args, Move) and op.inputs[0].level == Level.REGISTER
              and op.outputs[0].level == Level.REGISTER]
    assert len(inlane) == 9 and all(op.outputs[0].buffer.endswith("win") for op in inlane)
    g, _ = case
    node = g.graph.nodes[-1]
    cols = next(c for c in candidates(node, g.graph.tensors, "cuda", buffer_names(list(g.graph.tensors)))
                if c.label == "conv.depthwise.cols(style=cols, vec=4, split=1, rows=1)").build()
    (gather,) = _global_loads(cols)
    assert gather.inputs[0].num == 9 and gather.inputs[0].vec == 4 and strip.parallel == cols.parallel


def test_strip_is_offered_for_rows_wider_than_a_warp_only():
    assert {c.params.vec for c in strip_candidates(conv_case((1, 2, 6, 56), 3))} == {2, 4}
    assert strip_candidates(conv_case((1, 2, 7, 7), 7)) == []
    assert strip_candidates(conv_case((1, 2, 9, 40), 3), "cpu") == []


def test_flat_strip_keeps_every_lane_busy_and_loads_a_lane_vector_per_chunk():
    """Expected form over the flattened output (56-wide rows, vec 4): a unit per 128 consecutive
    outputs (3136 / 128 = 24.5 units a plane: units cross planes),
    9 chunk loads of x that are contiguous and vec-wide (the output's flat index plus a
    constant), the weights loaded per lane (a unit may hold two channels)."""
    case = conv_case((2, 3, 56, 56), 3)
    flat = next(c for c in strip_candidates(case) if c.params.layout == "flat").build()
    assert flat.parallel.units == 2 * 3 * 56 * 56 // 128
    loads = _global_loads(flat)
    assert len(loads) == 9 and all(op.inputs[0].vec == 4 and op.inputs[0].contiguous for op in loads)
    (w,) = [op for op in flat.ops if op.inputs and op.inputs[0].buffer == "w"]
    assert w.outputs[0].num == 9 and w.outputs[0].vec == 4


def dwconv_bn_silu_model(n: int, c: int, hw: int):
    """3x3 depthwise (padding 1, no bias) + BatchNormalization + SiLU, fp32, and its parameters."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    params = {"w": (rng.standard_normal((c, 1, 3, 3)) / 3).astype(np.float32),
              **{k: rng.standard_normal(c).astype(np.float32) for k in ("sc", "bi", "mu")},
              "var": (rng.random(c) + 0.5).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], group=c, kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("BatchNormalization", ["c", "sc", "bi", "mu", "var"], ["b"], epsilon=1e-5),
             helper.make_node("Sigmoid", ["b"], ["s"]), helper.make_node("Mul", ["b", "s"], ["y"])]
    vi = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [n, c, hw, hw]) for t in ("x", "y")]
    graph = helper.make_graph(nodes, "dw", vi[:1], vi[1:], [numpy_helper.from_array(a, k) for k, a in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), params


def test_search_picks_the_flat_strip_for_the_3x3_bn_silu_at_56x56():
    """EfficientNet-B0's 3x3 depthwise + BatchNorm + SiLU at 32x144x56x56 (the subgraph suite's
    row): the flat strip with the BatchNorm and SiLU as chunk maps of its vector, one kernel."""
    from powerfusion.compiler import compile_model
    (step,) = compile_model(dwconv_bn_silu_model(32, 144, 56)[0], "h200").kernel_steps
    labels = [t for _, t in step.gir.templates]
    assert len(step.gir.kernels()) == 1 and labels[0] == "conv.depthwise.strip(layout=flat, vec=4)", labels
    assert all(".chunk(kind=chunk, vec=4" in t for t in labels[1:]), labels
