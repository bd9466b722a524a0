"""ScatterND into a strided box (torch's slice assignment, the dynamo exporter's slice_scatter):
no index map the size of the data, and the same values as onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from tests.frontend.fe_helpers import check, make_model, run_ort
from onnx import helper

import powerfusion
from powerfusion.basic import Gather
from powerfusion.frontend import import_model
from powerfusion.frontend.ops_index import scatter_nd_box

RNG = np.random.default_rng(23)
DATA = RNG.standard_normal((9, 4, 5)).astype(np.float32)


def _rows(*values):
    return np.array(values, np.int64).reshape(-1, 1)


def _updates(indices):
    return RNG.standard_normal(indices.shape[:-1] + DATA.shape[indices.shape[-1]:]).astype(np.float32)


@pytest.mark.parametrize("indices", [
    _rows(*range(1, 9)),            # x[1:] = u: the mvit attention's slice assignment
    _rows(*range(4)),               # the first rows
    _rows(*range(9)),               # every row: the updates are the output
    _rows(1, 3, 5, 7),              # x[1::2] = u
    _rows(6, 4, 2),                 # a negative step
    _rows(-3, -2, -1),              # negative indices, wrapped
    np.stack(np.meshgrid([2, 3, 4], [1, 3], indexing="ij"), -1),   # a box over two axes, one strided
    _rows(2, 0, 5),                 # not a box: the general path
    _rows(1, 1),                    # a repeated index: the general path, the last write wins
], ids=["tail", "head", "all", "step2", "negative-step", "wrapped", "2-d-box", "not-a-box", "repeated"])
def test_scatter_nd_boxes_match_onnxruntime(indices):
    upd = _updates(indices)
    model = make_model("ScatterND", {"x": DATA, "u": upd}, {"i": indices}, inputs=["x", "i", "u"])
    check(model, {"x": DATA, "u": upd})


def test_box_detection():
    assert scatter_nd_box((9, 4), _rows(*range(1, 9))) == ((1,), (1,))
    assert scatter_nd_box((9, 4), _rows(6, 4, 2)) == ((6,), (-2,))
    assert scatter_nd_box((9, 4), np.stack(np.meshgrid([2, 3], [3, 1], indexing="ij"), -1)) == ((2, 3), (1, -2))
    assert scatter_nd_box((9, 4), _rows(2, 0, 5)) is None
    assert scatter_nd_box((9, 4), _rows(1, 1)) is None
    assert scatter_nd_box((9, 4), _rows(7, 8, 9)) is None          # out of range: the general path reports it
    assert scatter_nd_box((9, 4), np.array([[1, 2], [2, 3]], np.int64)) is None   # points, not a box


def _slice_assignment_model(rows: int, cols: int, step: int):
    """attn[:, :, 1::step, :] = attn[:, :, 1::step, :] + bias, as the dynamo exporter writes it for
    mvit's relative-position add: the sliced axis moved first, ScatterND, moved back."""
    n = len(range(1, rows, step))
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[2, 1, 0, 3]),
        helper.make_node("Slice", ["xt", "start", "stop", "axis0", "steps"], ["part"]),
        helper.make_node("Add", ["part", "bias"], ["upd"]),
        helper.make_node("ScatterND", ["xt", "idx", "upd"], ["yt"]),
        helper.make_node("Transpose", ["yt"], ["y"], perm=[2, 1, 0, 3]),
    ]
    x = RNG.standard_normal((1, 1, rows, cols)).astype(np.float32)
    consts = {"start": np.array([1], np.int64), "stop": np.array([rows], np.int64), "axis0": np.array([0], np.int64),
              "steps": np.array([step], np.int64), "idx": _rows(*range(1, rows, step)),
              "bias": RNG.standard_normal((n, 1, 1, cols)).astype(np.float32)}
    return make_model(None, {"x": x}, consts, nodes=nodes), {"x": x}


@pytest.mark.parametrize("step", [1, 3])
def test_slice_assignment_needs_no_index_map_the_size_of_the_data(step):
    """Each ScatterND of the dynamo export of mvit_v2_s became a Gather by a constant index map
    of the data's size (25089 x 393 int64, 79 MB, each built from a Python list of ~10M
    writes): 96 of them took the CPU session past 12 GiB. A box costs constants the size of
    its axis."""
    rows, cols = 512, 96
    model, _ = _slice_assignment_model(rows, cols, step)
    graph = import_model(model)
    bias = graph.constants.get("bias")
    sizes = {name: c.size for name, c in graph.constants.items() if c is not bias}
    assert sum(sizes.values()) <= 2 * rows, sizes
    assert (step != 1) == any(isinstance(n.op, Gather) for n in graph.nodes)


@pytest.mark.parametrize("step", [1, 3])
def test_slice_assignment_runs_on_the_cpu_session(step):
    model, feeds = _slice_assignment_model(64, 24, step)
    (got,) = powerfusion.InferenceSession(model.SerializeToString()).run(None, feeds)
    np.testing.assert_allclose(got, run_ort(model, feeds)["y"], rtol=1e-6, atol=1e-6)
