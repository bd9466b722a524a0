"""Index refits and writer checks on large slices look at a sample of units (patterns.py).
The sample must set each digit of u on its own: with a few random units the digits of
u % 64 come out correlated and a refit that is wrong on most units passed (the transposed K
of decode attention at KV 16384 read the wrong rows)."""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import I, J, U, evaluate
from powerfusion.gir.ir import Level, MemorySlice
from powerfusion.rewrite.patterns import SAMPLE_CAP, sampled_units, compact


def _everywhere(e, units, num, width):
    env = {"u": units[:, None, None], "i": np.arange(num)[None, :, None], "j": np.arange(width)[None, None, :]}
    return np.broadcast_to(evaluate(e, env), (len(units), num, width))


def test_refit_of_a_large_slice_holds_on_every_unit():
    units, num, width = np.arange(3072), 512, 32
    # the transposed K's address (17 nodes: refitted); the old sample fitted u % 64 as
    # u%2 + 3*(u/2%2) + 3*(u/4%2) + 8*(u/8%2) + ...
    index = ((U % 64) + (U // 64) * 1048576) + ((I * 32 + J) * 64)
    s = MemorySlice("k", Level.GLOBAL, index, num, width, "float32")
    assert len(units) * s.count > SAMPLE_CAP   # the sampled path
    got = compact(s, units)
    assert np.array_equal(_everywhere(got.index, units, num, width), _everywhere(index, units, num, width))


def test_sample_sets_each_digit_alone():
    units = np.arange(3072)
    picked = sampled_units(units, 16384, exprs=(U % 3248,))
    for bit in range(12):
        assert (1 << bit) in picked
    assert set(picked.tolist()) <= set(units.tolist())


def test_concat_of_concats_larger_than_the_sample_is_exact():
    """A roll of a 5-D tensor by 3 along two axes (Slice + Concat twice, as torch.roll exports in
    swin3d's shifted windows) then an Add: at 1x2x56x56x128 the split rule's sampled check
    accepted moves that read 1152 corner elements (d = 1, h < 3, w < 3) from the wrong writer."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from powerfusion import InferenceSession
    shape = [1, 2, 56, 56, 128]
    inits = [numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("z", 0), ("a2", 2), ("a3", 3), ("m3", -3), ("big", 2**63 - 1))]
    nodes = [helper.make_node("Slice", ["x", "m3", "big", "a2"], ["h1"]),
             helper.make_node("Slice", ["x", "z", "m3", "a2"], ["h2"]),
             helper.make_node("Concat", ["h1", "h2"], ["c2"], axis=2),
             helper.make_node("Slice", ["c2", "m3", "big", "a3"], ["w1"]),
             helper.make_node("Slice", ["c2", "z", "m3", "a3"], ["w2"]),
             helper.make_node("Concat", ["w1", "w2"], ["c3"], axis=3),
             helper.make_node("Add", ["y", "c3"], ["out"])]
    graph = helper.make_graph(nodes, "roll", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "xy"],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert int(np.prod(shape)) > SAMPLE_CAP
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    got = InferenceSession(model, target="cpu-reference").run(None, {"x": x, "y": y})[0]
    np.testing.assert_array_equal(got, y + np.roll(x, (3, 3), axis=(2, 3)))
