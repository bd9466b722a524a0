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


def _involution_model(n, c, hw, groups, k, stride=1, broadcast=True):
    """RedNet's form: stack the k x k taps of Pad(x), view as [N, G, C/G, K*K, positions], times
    the kernel [N, G, 1, K*K, positions], summed over the taps (models/rednet.py)."""
    p = k // 2
    ho = (hw + 2 * p - k) // stride + 1
    consts = {"pads": np.array([0, 0, p, p, 0, 0, p, p], np.int64), "a23": np.array([2, 3], np.int64),
              "ax": np.array([2], np.int64), "st": np.array([stride, stride], np.int64),
              "vx": np.array([n, groups, c // groups, k * k, ho * ho], np.int64),
              "vk": np.array([n, groups, 1, k * k, ho * ho], np.int64), "r3": np.array([3], np.int64),
              "vy": np.array([n, c, ho, ho], np.int64)}
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"])]
    for t, (i, j) in enumerate(itertools.product(range(k), range(k))):
        consts[f"s{t}"] = np.array([i, j], np.int64)
        consts[f"e{t}"] = np.array([i + stride * (ho - 1) + 1, j + stride * (ho - 1) + 1], np.int64)
        nodes += [helper.make_node("Slice", ["xp", f"s{t}", f"e{t}", "a23", "st"], [f"tap{t}"]),
                  helper.make_node("Unsqueeze", [f"tap{t}", "ax"], [f"u{t}"])]
    nodes += [helper.make_node("Concat", [f"u{t}" for t in range(k * k)], ["stack"], axis=2),
              helper.make_node("Reshape", ["stack", "vx"], ["patches"]),
              helper.make_node("Reshape", ["kern", "vk"], ["weight"]),
              helper.make_node("Mul", ["weight", "patches"] if broadcast else ["patches", "weight"], ["prod"]),
              helper.make_node("ReduceSum", ["prod", "r3"], ["s"], keepdims=0),
              helper.make_node("Reshape", ["s", "vy"], ["y"])]
    feeds = {"x": RNG.standard_normal((n, c, hw, hw)).astype(np.float32),
             "kern": RNG.standard_normal((n, groups * k * k, ho, ho)).astype(np.float32)}
    return make_model(None, feeds, consts, nodes=nodes), feeds


@pytest.mark.parametrize("args", [(2, 16, 9, 4, 3, 1), (1, 8, 12, 2, 7, 2), (1, 4, 8, 4, 3, 1)],
                         ids=["3x3-g4", "7x7-s2", "one-channel-per-group"])
def test_involution_becomes_one_op_and_matches_onnxruntime(args):
    from powerfusion.basic import Involution
    from powerfusion.frontend.involution import fold_involutions
    model, feeds = _involution_model(*args)
    graph, count = _folded(model)
    assert count == 1 and fold_involutions(graph) == 1
    validate(graph)
    kinds = [type(n.op) for n in graph.nodes]
    assert Involution in kinds and Window not in kinds and Concat not in kinds
    np.testing.assert_allclose(run_basic_graph(graph, feeds)["y"], run_ort(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_a_product_used_elsewhere_is_not_folded():
    """The product of taps and kernels read by a second consumer must stay materialised."""
    from powerfusion.frontend.involution import fold_involutions
    model, feeds = _involution_model(1, 8, 6, 2, 3)
    model.graph.node.append(helper.make_node("Identity", ["prod"], ["extra"]))
    model.graph.output.append(helper.make_tensor_value_info("extra", 1, [1, 2, 4, 9, 36]))
    graph, _ = _folded(model)
    assert fold_involutions(graph) == 0


def _summed_involution_model(n, c, hw, groups, k, swap=False):
    """Involution tap by tap: sum over taps of Reshape(Slice(Pad(x))) * Slice(kern, k:k+1);
    `swap` pairs taps 0 and 1 with each other's kernel slice (not an involution any more)."""
    p = k // 2
    consts = {"pads": np.array([0, 0, p, p, 0, 0, p, p], np.int64), "a23": np.array([2, 3], np.int64),
              "a2": np.array([2], np.int64), "v": np.array([n, groups, c // groups, hw, hw], np.int64),
              "vy": np.array([n, c, hw, hw], np.int64)}
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"])]
    acc = None
    for t, (i, j) in enumerate(itertools.product(range(k), range(k))):
        kk = {0: 1, 1: 0}.get(t, t) if swap else t
        consts[f"s{t}"], consts[f"e{t}"] = np.array([i, j], np.int64), np.array([i + hw, j + hw], np.int64)
        consts[f"k{t}"], consts[f"l{t}"] = np.array([kk], np.int64), np.array([kk + 1], np.int64)
        nodes += [helper.make_node("Slice", ["xp", f"s{t}", f"e{t}", "a23"], [f"tap{t}"]),
                  helper.make_node("Reshape", [f"tap{t}", "v"], [f"g{t}"]),
                  helper.make_node("Slice", ["kern", f"k{t}", f"l{t}", "a2"], [f"w{t}"]),
                  helper.make_node("Mul", [f"g{t}", f"w{t}"], [f"m{t}"])]
        if acc is not None:
            nodes.append(helper.make_node("Add", [acc, f"m{t}"], [f"acc{t}"]))
        acc = f"m{t}" if acc is None else f"acc{t}"
    nodes.append(helper.make_node("Reshape", [acc, "vy"], ["y"]))
    feeds = {"x": RNG.standard_normal((n, c, hw, hw)).astype(np.float32),
             "kern": RNG.standard_normal((n, groups, k * k, hw, hw)).astype(np.float32)}
    return make_model(None, feeds, consts, nodes=nodes), feeds


@pytest.mark.parametrize("swap", [False, True], ids=["taps-in-order", "two-kernels-swapped"])
def test_tap_by_tap_involution(swap):
    """Written tap by tap (a sum of window taps times kernel slices) it is one Involution too;
    with two taps paired with each other's kernel slice it is not, and stays as written."""
    from powerfusion.basic import Involution
    from powerfusion.frontend.involution import fold_involutions
    model, feeds = _summed_involution_model(2, 8, 7, 2, 3, swap)
    graph = import_model(model)
    assert fold_involutions(graph) == (0 if swap else 1)
    validate(graph)
    assert (Involution in [type(n.op) for n in graph.nodes]) != swap
    np.testing.assert_allclose(run_basic_graph(graph, feeds)["y"], run_ort(model, feeds)["y"], rtol=1e-5, atol=1e-5)
