"""Stacked window taps (Pad -> shifted Slices -> Unsqueeze -> Concat, as torch.stack of unfold
taps exports) become one Window, and still compute what onnxruntime computes."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from powerfusion.basic import Concat, Slice, Window
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.window_stack import fold_window_stacks
from tests.frontend.fe_helpers import make_model, run_ort, validate

RNG = np.random.default_rng(5)


def _stack_model(x_shape, k, stride=1, dil=1, pad=True, axis=2, order=None, two_step=True, other=None):
    """out = stack(taps, axis) * w summed over the taps (involution's core), taps the k x k windows
    of Pad(x) (or of x itself when pad=False) in row-major order unless `order` permutes them;
    `other` names a tap (index) read from a second input instead, which must stop the fold."""
    n, c, h, w = x_shape
    p = dil * (k - 1) // 2 if pad else 0
    ho = (h + 2 * p - dil * (k - 1) - 1) // stride + 1
    wo = (w + 2 * p - dil * (k - 1) - 1) // stride + 1
    consts, nodes = {}, []
    src = "x"
    if pad:
        consts["pads"] = np.array([0, 0, p, p, 0, 0, p, p], np.int64)
        nodes.append(helper.make_node("Pad", ["x", "pads"], ["xp"]))
        src = "xp"
    taps = list(itertools.product(range(k), range(k)))
    if order is not None:
        taps = [taps[i] for i in order]
    names = []
    for t, (i, j) in enumerate(taps):
        base = "x2" if other == t else src
        hs, ws = i * dil, j * dil
        he, we = hs + stride * (ho - 1) + 1, ws + stride * (wo - 1) + 1
        for nm, v in ((f"s{t}", [hs, ws]), (f"e{t}", [he, we]), (f"st{t}", [stride, stride]),
                      (f"sh{t}", [hs]), (f"eh{t}", [he]), (f"sw{t}", [ws]), (f"ew{t}", [we]),
                      (f"one{t}", [stride])):
            consts[nm] = np.array(v, np.int64)
        consts.setdefault("a23", np.array([2, 3], np.int64))
        consts.setdefault("a2", np.array([2], np.int64))
        consts.setdefault("a3", np.array([3], np.int64))
        if two_step:    # torch's export: rows first, then columns
            nodes.append(helper.make_node("Slice", [base, f"sh{t}", f"eh{t}", "a2", f"one{t}"], [f"r{t}"]))
            nodes.append(helper.make_node("Slice", [f"r{t}", f"sw{t}", f"ew{t}", "a3", f"one{t}"], [f"tap{t}"]))
        else:
            nodes.append(helper.make_node("Slice", [base, f"s{t}", f"e{t}", "a23", f"st{t}"], [f"tap{t}"]))
        consts.setdefault("ax", np.array([axis], np.int64))
        nodes.append(helper.make_node("Unsqueeze", [f"tap{t}", "ax"], [f"u{t}"]))
        names.append(f"u{t}")
    nodes.append(helper.make_node("Concat", names, ["stack"], axis=axis))
    wshape = [n, c, ho, wo]
    wshape.insert(axis, k * k)
    feeds = {"x": RNG.standard_normal(x_shape).astype(np.float32),
             "w": RNG.standard_normal(wshape).astype(np.float32)}
    if other is not None:
        feeds["x2"] = RNG.standard_normal(feeds["x"].shape if not pad else
                                          (n, c, h + 2 * p, w + 2 * p)).astype(np.float32)
    consts["rax"] = np.array([axis], np.int64)
    nodes += [helper.make_node("Mul", ["stack", "w"], ["prod"]),
              helper.make_node("ReduceSum", ["prod", "rax"], ["y"], keepdims=0)]
    return make_model(None, feeds, consts, nodes=nodes), feeds


def _folded(model):
    graph = import_model(model)
    count = fold_window_stacks(graph)
    validate(graph)
    return graph, count


@pytest.mark.parametrize("kw", [
    dict(k=3), dict(k=7), dict(k=7, stride=2), dict(k=3, dil=2), dict(k=3, pad=False),
    dict(k=3, axis=4), dict(k=3, axis=0), dict(k=5, two_step=False), dict(k=3, stride=2, two_step=False),
], ids=["3x3", "7x7", "7x7-stride2", "dilated", "no-pad", "axis-last", "axis-first", "5x5-one-slice",
        "stride2-one-slice"])
def test_stacked_taps_become_one_window(kw):
    model, feeds = _stack_model((1, 4, 9, 11), **kw)
    graph, count = _folded(model)
    assert count == 1
    kinds = [type(n.op) for n in graph.nodes]
    assert Window in kinds and Concat not in kinds and Slice not in kinds
    want = run_ort(model, feeds)["y"]
    got = run_basic_graph(graph, feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)   # float32: sum order only


@pytest.mark.parametrize("kw", [dict(order=[1, 0, 2, 3, 4, 5, 6, 7, 8]), dict(other=4)],
                         ids=["taps-out-of-order", "tap-from-another-tensor"])
def test_stacks_that_are_not_windows_stay(kw):
    model, feeds = _stack_model((1, 4, 9, 11), k=3, **kw)
    graph, count = _folded(model)
    assert count == 0
    assert Concat in [type(n.op) for n in graph.nodes]
    np.testing.assert_allclose(run_basic_graph(graph, feeds)["y"], run_ort(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_bundled_rednet_stacks_fold_and_match_onnxruntime():
    """rednet_small's five involutions (3x3 and 7x7, strides 1 and 2) each become a Window, and
    the CPU session matches onnxruntime (float32; 1e-4 relative over 20 layers)."""
    import powerfusion
    from powerfusion.pipeline.driver import front
    path = str(Path(__file__).resolve().parents[3] / "models" / "small" / "rednet_small.onnx")
    part = front(path, "cpu")
    ops = [type(n.op) for n in part.graph.nodes]
    assert ops.count(Window) >= 5 and Concat not in ops
    sess = powerfusion.InferenceSession(path, target="cpu-reference")
    x = RNG.standard_normal(sess.get_inputs()[0].shape).astype(np.float32)
    import onnxruntime as ort
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {sess.get_inputs()[0].name: x})[0]
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
