"""One-pass statistics (rewrite/onepass.py): the rule's before / expected pair and the cases it
must refuse; numerics of the rewritten LayerNorm / InstanceNorm in the interpreter against
float64 at rows up to 65536 and at large offsets (mean 1e4, std 1); the cost model's choice
(one-pass where the row is streamed, two-pass where it fits registers); and, marked gpu, the
rewritten graph on CUDA.

Tolerances (float32 data, float32 registers): the inverse standard deviation within 2e-4
relative of float64 -- the two-pass form's own error at D = 65536 and offset 1e4 is below
1e-5 and the naive sum(x^2) - n m^2 form's is above 1 (asserted below, so the bound can
fail); the mean within 4 float32 ulps of the offset (float32 cannot hold it closer); outputs
within 2e-3 of float64 relative to the output's scale (the mean's rounding, 5e-4 of a unit at
1e4, times gamma)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from onnx import TensorProto as TP, helper as h, numpy_helper as nh

from conftest import require_tool
from powerfusion.frontend import import_model, partition_graph
from powerfusion.gir.expr import I, J, U
from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.ir import Broadcast, Elementwise, GOp, Level, Move, Reduce
from powerfusion.rewrite import optimise
from powerfusion.gir.interpreter import sumexp
from powerfusion.rewrite.onepass import (ONEPASS_RULES, apply_one_pass, one_pass_variant, online_softmax,
                                         shifted_variance)
from powerfusion.templates.merge import lower_subgraph
from tests.rewrite.util import gbuf, glob, graph, graphs_equal, random_feeds, reg, show

# ---- before / expected ----------------------------------------------------------------------

NUM, W = 2, 4


def _op(args, ins, out):
    return GOp(args, tuple(ins), (out,))


def _variance_graph(square_of_other=False, masked=False, mean_written_twice=False):
    """Per unit: x (2 x 4) -> sum, mean row, sum of (x - mean)^2; both sums stored."""
    valid = (I * W + J).lt(7) if masked else None
    X, Mt, D, Q = (reg(n, NUM, W, valid=valid if n == "X" else None) for n in ("X", "Mt", "D", "Q"))
    P1, Mw, P2 = reg("P1", 1, W), reg("Mw", 1, W), reg("P2", 1, W)
    S1, S2 = reg("S1", 1, 1), reg("S2", 1, 1)
    ops = [_op(Move(), [glob("x", U * 8 + I * W + J, NUM, W, valid=valid)], X),
           _op(Reduce("sum", "num"), [X], P1), _op(Reduce("sum", "width"), [P1], S1),
           _op(Broadcast("width"), [S1], Mw)]
    if mean_written_twice:
        ops.append(_op(Broadcast("width"), [S1], Mw))
    ops += [_op(Broadcast("num"), [Mw], Mt), _op(Elementwise("sub"), [X, Mt], D),
            _op(Elementwise("mul"), [D, X if square_of_other else D], Q),
            _op(Reduce("sum", "num"), [Q], P2), _op(Reduce("sum", "width"), [P2], S2),
            _op(Move(), [S2], glob("s2", U, 1, 1)), _op(Move(), [S1], glob("s1", U, 1, 1))]
    bufs = [gbuf("x", 32), gbuf("s1", 4), gbuf("s2", 4)] + [
        gbuf(n, NUM * W, Level.REGISTER) for n in ("X", "Mt", "D", "Q")] + [
        gbuf(n, W, Level.REGISTER) for n in ("P1", "Mw", "P2")] + [gbuf(n, 1, Level.REGISTER) for n in ("S1", "S2")]
    return graph(ops, bufs, ["x"], ["s2", "s1"]), ops.index(next(o for o in ops if o.args == Reduce("sum", "num")
                                                                 and o.inputs[0].buffer == "Q"))


def _expected():
    X, Mt, D = reg("X", NUM, W), reg("Mt", NUM, W), reg("D", NUM, W)
    P1, Mw, S1, S2 = reg("P1", 1, W), reg("Mw", 1, W), reg("S1", 1, 1), reg("S2", 1, 1)
    row = {n: reg(f"X_{n}", 1, W) for n in ("row0", "shifted_sum", "shifted_sqsum", "slot_mean", "slot_sq",
                                             "slot_m2", "slot_off", "slot_dev", "slot_dev_sq", "slot_dev_n",
                                             "slot_total")}
    tile = {n: reg(f"X_{n}", NUM, W) for n in ("shift", "shifted", "shifted_sq")}
    ew = lambda fn, ins, out, **p: _op(Elementwise(fn, tuple(sorted(p.items()))), ins, out)  # noqa: E731
    ops = [_op(Move(), [glob("x", U * 8 + I * W + J, NUM, W)], X),
           _op(Move(), [glob("x", U * 8 + J, 1, W)], row["row0"]),
           _op(Reduce("sum", "num"), [X], P1),
           _op(Broadcast("num"), [row["row0"]], tile["shift"]),
           ew("sub", [X, tile["shift"]], tile["shifted"]),
           _op(Reduce("sum", "num"), [tile["shifted"]], row["shifted_sum"]),
           ew("mul", [tile["shifted"], tile["shifted"]], tile["shifted_sq"]),
           _op(Reduce("sum", "num"), [tile["shifted_sq"]], row["shifted_sqsum"]),
           _op(Reduce("sum", "width"), [P1], S1), _op(Broadcast("width"), [S1], Mw),
           _op(Broadcast("num"), [Mw], Mt), ew("sub", [X, Mt], D),
           ew("affine", [row["shifted_sum"]], row["slot_mean"], alpha=0.5, beta=0.0),
           ew("mul", [row["shifted_sum"], row["slot_mean"]], row["slot_sq"]),
           ew("sub", [row["shifted_sqsum"], row["slot_sq"]], row["slot_m2"]),
           ew("sub", [row["row0"], Mw], row["slot_off"]),
           ew("add", [row["slot_off"], row["slot_mean"]], row["slot_dev"]),
           ew("mul", [row["slot_dev"], row["slot_dev"]], row["slot_dev_sq"]),
           ew("affine", [row["slot_dev_sq"]], row["slot_dev_n"], alpha=2.0, beta=0.0),
           ew("add", [row["slot_m2"], row["slot_dev_n"]], row["slot_total"]),
           _op(Reduce("sum", "width"), [row["slot_total"]], S2),
           _op(Move(), [S2], glob("s2", U, 1, 1)), _op(Move(), [S1], glob("s1", U, 1, 1))]
    bufs = [gbuf("x", 32), gbuf("s1", 4), gbuf("s2", 4)] + [
        gbuf(n, NUM * W, Level.REGISTER) for n in ("X", "Mt", "D")] + [
        gbuf(n, W, Level.REGISTER) for n in ("P1", "Mw")] + [gbuf(n, 1, Level.REGISTER) for n in ("S1", "S2")] + [
        gbuf(s.buffer, W, Level.REGISTER) for s in row.values()] + [
        gbuf(s.buffer, NUM * W, Level.REGISTER) for s in tile.values()]
    return graph(ops, bufs, ["x"], ["s2", "s1"])


def _check_rule(rule, before, at, expected):
    """As util.check_rule, but the outputs are compared to float32 rounding, not bit for bit:
    a one-pass rule sums in another order."""
    rw = rule(before, at)
    after = rw.apply(before) if rw is not None else None
    msg = f"\nbefore:\n{show(before)}\nafter:\n{show(after)}\nexpected:\n{show(expected)}"
    assert graphs_equal(after, expected), msg
    if after is not None:
        feeds = random_feeds(before)
        want, got = run_gir(before, feeds), run_gir(after, feeds)
        for n in before.outputs:
            np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-5, err_msg=n + msg)


def test_shifted_variance_before_expected():
    before, at = _variance_graph()
    _check_rule(shifted_variance, before, at, _expected())


@pytest.mark.parametrize("case", ["square_of_other", "masked", "mean_written_twice"])
def test_shifted_variance_refuses(case):
    before, at = _variance_graph(**{case: True})
    _check_rule(shifted_variance, before, at, None)


def _softmax_graph(with_max_pass=True, exp_of_x=False):
    """Per unit: x (2 x 4) -> row max, e = exp(x - max), its sum; the sum and e stored."""
    X, Mt, D, E = (reg(n, NUM, W) for n in ("X", "Mt", "D", "E"))
    Pm, Mw, P2, M, S = reg("Pm", 1, W), reg("Mw", 1, W), reg("P2", 1, W), reg("M", 1, 1), reg("S", 1, 1)
    first = _op(Reduce("max", "num"), [X], Pm) if with_max_pass else _op(Reduce("max", "num"), [D], Pm)
    ops = [_op(Move(), [glob("x", U * 8 + I * W + J, NUM, W)], X), _op(Move(), [glob("x", U * 8 + I * W + J, NUM, W)], D),
           first, _op(Reduce("max", "width"), [Pm], M), _op(Broadcast("width"), [M], Mw),
           _op(Broadcast("num"), [Mw], Mt), _op(Elementwise("sub"), [X, Mt], D),
           _op(Elementwise("exp"), [X if exp_of_x else D], E),
           _op(Reduce("sum", "num"), [E], P2), _op(Reduce("sum", "width"), [P2], S),
           _op(Move(), [S], glob("s", U, 1, 1)), _op(Move(), [E], glob("e", U * 8 + I * W + J, NUM, W))]
    if with_max_pass:
        del ops[1]
    bufs = [gbuf("x", 32), gbuf("s", 4), gbuf("e", 32)] + [gbuf(n, NUM * W, Level.REGISTER) for n in ("X", "Mt", "D", "E")] + [
        gbuf(n, W, Level.REGISTER) for n in ("Pm", "Mw", "P2")] + [gbuf(n, 1, Level.REGISTER) for n in ("M", "S")]
    return graph(ops, bufs, ["x"], ["s", "e"]), next(k for k, o in enumerate(ops) if o.args == Reduce("sum", "num"))


def _softmax_expected():
    X, Mt, D, E = (reg(n, NUM, W) for n in ("X", "Mt", "D", "E"))
    Pm, Mw, M, S = reg("Pm", 1, W), reg("Mw", 1, W), reg("M", 1, 1), reg("S", 1, 1)
    row = {n: reg(f"X_{n}", 1, W) for n in ("slot_sumexp", "slot_off", "slot_scale", "slot_total")}
    ops = [_op(Move(), [glob("x", U * 8 + I * W + J, NUM, W)], X), _op(Reduce("max", "num"), [X], Pm),
           _op(Reduce("sumexp", "num"), [X], row["slot_sumexp"]),
           _op(Reduce("max", "width"), [Pm], M), _op(Broadcast("width"), [M], Mw), _op(Broadcast("num"), [Mw], Mt),
           _op(Elementwise("sub"), [X, Mt], D), _op(Elementwise("exp"), [D], E),
           _op(Elementwise("sub"), [Pm, Mw], row["slot_off"]), _op(Elementwise("exp"), [row["slot_off"]], row["slot_scale"]),
           _op(Elementwise("mul"), [row["slot_sumexp"], row["slot_scale"]], row["slot_total"]),
           _op(Reduce("sum", "width"), [row["slot_total"]], S),
           _op(Move(), [S], glob("s", U, 1, 1)), _op(Move(), [E], glob("e", U * 8 + I * W + J, NUM, W))]
    bufs = [gbuf("x", 32), gbuf("s", 4), gbuf("e", 32)] + [gbuf(n, NUM * W, Level.REGISTER) for n in ("X", "Mt", "D", "E")] + [
        gbuf(n, W, Level.REGISTER) for n in ("Pm", "Mw")] + [gbuf(n, 1, Level.REGISTER) for n in ("M", "S")] + [
        gbuf(s.buffer, W, Level.REGISTER) for s in row.values()]
    return graph(ops, bufs, ["x"], ["s", "e"])


def test_online_softmax_before_expected():
    before, at = _softmax_graph()
    _check_rule(online_softmax, before, at, _softmax_expected())


@pytest.mark.parametrize("case", ["with_max_pass", "exp_of_x"])
def test_online_softmax_refuses(case):
    before, at = _softmax_graph(**{"with_max_pass": case != "with_max_pass", "exp_of_x": case == "exp_of_x"})
    _check_rule(online_softmax, before, at, None)


def test_sumexp_semantics():
    """reduce(sumexp): sum of exp(x - max) over the valid elements, an element equal to the max
    counting 1 (so -inf-only and +inf slots give counts, not NaN); masked elements skipped."""
    inf = np.inf
    v = np.array([[[0.0, -inf, -inf], [1.0, -inf, inf], [2.0, -inf, 3.0]]], np.float32)   # 1 unit, num 3, width 3
    mask = np.ones_like(v, bool)
    mask[0, 2, 2] = False
    got = sumexp(v, mask, 1)
    want = [np.exp(-2.0) + np.exp(-1.0) + 1.0, 3.0, 1.0]
    np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-6)


def test_every_one_pass_rule_has_a_test_here():
    assert set(ONEPASS_RULES.values()) == {shifted_variance, online_softmax}
    assert all(rule.kinds == {"reduce"} for rule in ONEPASS_RULES.values())


# ---- lowered models: numerics against float64 ------------------------------------------------

def _model(kind: str, shape, dtype=TP.FLOAT):
    rng = np.random.default_rng(0)
    D = shape[-1] if kind != "instancenorm" else shape[1]
    g = rng.standard_normal(D).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    outs = [h.make_tensor_value_info("y", dtype, shape)]
    if kind == "layernorm":
        stat = list(shape[:-1]) + [1]
        node = h.make_node("LayerNormalization", ["x", "g", "b"], ["y", "mean", "inv"], axis=-1, epsilon=1e-5)
        outs += [h.make_tensor_value_info("mean", TP.FLOAT, stat), h.make_tensor_value_info("inv", TP.FLOAT, stat)]
        inits = [nh.from_array(g.astype(_np(dtype)), "g"), nh.from_array(b.astype(_np(dtype)), "b")]
    elif kind == "add_layernorm":
        node = [h.make_node("Add", ["x", "r"], ["s"]),
                h.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
        inits = [nh.from_array(g, "g"), nh.from_array(b, "b")]
    else:
        node = h.make_node("InstanceNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5)
        inits = [nh.from_array(g, "g"), nh.from_array(b, "b")]
    ins = [h.make_tensor_value_info("x", dtype, shape)] + (
        [h.make_tensor_value_info("r", dtype, shape)] if kind == "add_layernorm" else [])
    gr = h.make_graph(node if isinstance(node, list) else [node], "m", ins, outs, inits)
    m = h.make_model(gr, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m, g.astype(np.float64), b.astype(np.float64)


def _np(dtype):
    return {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}[dtype]


def lowered(model):
    """The default plan of the model's one memory-bound subgraph, merged and optimised."""
    graph = import_model(model)
    (sub,) = partition_graph(graph, "cuda").subgraphs
    merged = lower_subgraph(sub, graph, None, target="cuda")
    return optimise(merged)[0]


def _reference(kind, x, g, b, r=None):
    x = x.astype(np.float64) + (0 if r is None else r.astype(np.float64))
    axes = (-1,) if kind != "instancenorm" else tuple(range(2, x.ndim))
    mu = x.mean(axes, keepdims=True)
    var = x.var(axes, keepdims=True)
    shape = (1, -1) + (1,) * (x.ndim - 2) if kind == "instancenorm" else (-1,)
    y = (x - mu) / np.sqrt(var + 1e-5) * g.reshape(shape) + b.reshape(shape)
    return y, mu, 1 / np.sqrt(var + 1e-5)


def _run(g, feeds):
    return run_gir(g, {n: np.ascontiguousarray(feeds[n]) for n in g.inputs})


@pytest.mark.parametrize("D", [256, 4096, 65536])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_layernorm_one_pass_against_float64(D, offset):
    model, gam, bet = _model("layernorm", [2, D])
    two = lowered(model)
    one, trace = apply_one_pass(two)
    assert [s.rule for s in trace] == ["sum((x - m)^2) => shifted slot sums"]
    x = (offset + np.random.default_rng(D).standard_normal((2, D))).astype(np.float32)
    y_ref, mu_ref, inv_ref = _reference("layernorm", x, gam, bet)
    got, base = _run(one, {"x": x}), _run(two, {"x": x})
    np.testing.assert_allclose(got["inv"].reshape(2, 1), inv_ref, rtol=2e-4)
    np.testing.assert_allclose(base["inv"].reshape(2, 1), inv_ref, rtol=2e-4)
    ulp = np.spacing(np.float32(max(offset, 1.0)))
    np.testing.assert_allclose(got["mean"].reshape(2, 1), mu_ref, atol=4 * ulp + 1e-6)
    scale = np.abs(gam).max()
    assert np.abs(got["y"].reshape(2, D) - y_ref).max() <= 2e-3 * scale


def test_naive_one_pass_variance_fails_the_same_bound():
    """The bound above can fail: sum(x^2)/n - m^2 in float32 at offset 1e4 is far outside it."""
    x = (1e4 + np.random.default_rng(0).standard_normal(65536)).astype(np.float32)
    naive = np.float32(np.sum(x * x, dtype=np.float32) / x.size) - np.float32(np.mean(x, dtype=np.float32)) ** 2
    assert abs(naive - x.astype(np.float64).var()) > 0.5


@pytest.mark.parametrize("kind,shape", [("add_layernorm", [4, 2048]), ("instancenorm", [2, 3, 64, 64])])
def test_fused_and_spatial_statistics_against_float64(kind, shape):
    model, gam, bet = _model(kind, shape)
    one, trace = apply_one_pass(lowered(model))
    assert trace, f"the one-pass rule did not apply to {kind}"
    rng = np.random.default_rng(1)
    x = (1e4 + rng.standard_normal(shape)).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32) if kind == "add_layernorm" else None
    y_ref = _reference(kind, x, gam, bet, r)[0]
    got = _run(one, {"x": x, "r": r})["y"].reshape(shape)
    assert np.abs(got - y_ref).max() <= 2e-3 * np.abs(gam).max()


@functools.lru_cache(maxsize=None)
def _variant(kind: str, D: int):
    two = lowered(_model("layernorm", [2, D])[0] if kind == "layernorm" else _softmax_model([2, D]))
    return two, one_pass_variant(two)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["layernorm", "softmax"]), st.sampled_from([256, 512, 1024, 3072]),
       st.floats(-1e4, 1e4), st.floats(0.01, 100.0))
def test_every_one_pass_step_keeps_outputs(kind, D, offset, std):
    """Property: after each one-pass rule application (and the clean-up rewrites after it) the
    interpreter gives what the two-pass graph gives, to float32 rounding of the data's scale."""
    two, variant = _variant(kind, D)
    assert variant is not None
    x = (offset + std * np.random.default_rng(D).standard_normal((2, D))).astype(np.float32)
    want = _run(two, {"x": x})
    for step in variant[1]:
        got = _run(step.after, {"x": x})
        if kind == "layernorm":
            np.testing.assert_allclose(got["inv"], want["inv"], rtol=5e-4, err_msg=step.rule)
        scale = (2e-3 if kind == "layernorm" else 1e-5) * np.abs(want["y"]).max()
        np.testing.assert_allclose(got["y"], want["y"], atol=scale, err_msg=step.rule)


def _softmax_model(shape, masked=False):
    nodes = [h.make_node("Softmax", ["x"], ["y"], axis=-1)]
    if masked:
        nodes = [h.make_node("Mul", ["x", "scale"], ["xs"]), h.make_node("Add", ["xs", "mask"], ["xm"]),
                 h.make_node("Softmax", ["xm"], ["y"], axis=-1)]
    inits = [nh.from_array(np.array(0.125, np.float32), "scale")] if masked else []
    ins = [h.make_tensor_value_info("x", TP.FLOAT, shape)] + (
        [h.make_tensor_value_info("mask", TP.FLOAT, [1, shape[-1]])] if masked else [])
    gr = h.make_graph(nodes, "m", ins, [h.make_tensor_value_info("y", TP.FLOAT, shape)], inits)
    m = h.make_model(gr, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _softmax_inputs(shape, offset, seed=0):
    """Logits around `offset` (std 3), the first 100 of each row -inf (a padding mask)."""
    x = (offset + 3 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)
    x[..., :100] = -np.inf
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    return x, e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("D", [384, 4096, 65536])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_softmax_one_pass_against_float64(D, offset):
    """Every output within 2e-6 of the largest (float32: the exp's and the sum's rounding); a
    log-sum-exp scalar at offset 1e4 would be off by up to 5e-4 relative (its ulp there)."""
    two = lowered(_softmax_model([2, D]))
    one, trace = apply_one_pass(two)
    assert [s.rule for s in trace] == ["max(x) ; sum(exp(x - m)) => online slot sums"]
    x, ref = _softmax_inputs((2, D), offset)
    got = _run(one, {"x": x})["y"].reshape(2, D)
    assert np.abs(got - ref).max() <= 2e-6 * ref.max()
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


def test_scale_mask_softmax_one_pass_against_float64():
    shape = [2, 3, 384]
    one, trace = apply_one_pass(lowered(_softmax_model(shape, masked=True)))
    assert trace
    rng = np.random.default_rng(3)
    x = (1e3 + rng.standard_normal(shape)).astype(np.float32)
    mask = np.where(rng.random((1, 384)) < 0.3, -1e4, 0.0).astype(np.float32)
    z = x.astype(np.float64) * 0.125 + mask
    e = np.exp(z - z.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    got = _run(one, {"x": x, "mask": mask})["y"].reshape(shape)
    assert np.abs(got - ref).max() <= 2e-6 * ref.max()


def test_rmsnorm_is_one_statistic_already():
    """RMSNorm reduces its row once (the mean of squares): the rule has nothing to join."""
    D = 4096
    nodes = [h.make_node("Mul", ["x", "x"], ["sq"]), h.make_node("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1),
             h.make_node("Add", ["ms", "eps"], ["v"]), h.make_node("Sqrt", ["v"], ["s"]),
             h.make_node("Div", ["x", "s"], ["y"])]
    inits = [nh.from_array(np.array([-1], np.int64), "ax"), nh.from_array(np.array(1e-6, np.float32), "eps")]
    gr = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", TP.FLOAT, [2, D])],
                      [h.make_tensor_value_info("y", TP.FLOAT, [2, D])], inits)
    m = h.make_model(gr, opset_imports=[h.make_opsetid("", 18)])
    m.ir_version = 8
    g = lowered(m)
    assert sum(isinstance(op.args, Reduce) and op.args.over == "num" for op in g.ops) == 1
    assert apply_one_pass(g)[1] == []


# ---- the cost model chooses ------------------------------------------------------------------

@pytest.mark.parametrize("kind,D,one_pass_wins", [("layernorm", 65536, True), ("layernorm", 1024, False),
                                                  ("softmax", 65536, True), ("softmax", 1024, False)])
def test_cost_model_picks_one_pass_only_for_streamed_rows(kind, D, one_pass_wins):
    from powerfusion.perfmodel.cost import estimate, predict_seconds
    from powerfusion.targets.specs import get_target
    t = get_target("h200")
    model = _model("layernorm", [512, D])[0] if kind == "layernorm" else _softmax_model([512, D])
    two = lowered(model)
    one = one_pass_variant(two)[0]
    p_two, p_one = (predict_seconds(estimate(g, t), t) for g in (two, one))
    assert (p_one < p_two) == one_pass_wins, (p_one, p_two)


# ---- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 65536])
def test_one_pass_layernorm_on_gpu(D):
    from tests.rewrite.test_gpu_rewritten import _run_on_gpu
    model, gam, bet = _model("layernorm", [8, D])
    one, trace = apply_one_pass(lowered(model))
    assert trace
    x = (1e4 + np.random.default_rng(2).standard_normal((8, D))).astype(np.float32)
    y_ref, _, inv_ref = _reference("layernorm", x, gam, bet)
    got = _run_on_gpu(one, {"x": x})
    np.testing.assert_allclose(got["inv"].reshape(8, 1), inv_ref, rtol=2e-4)
    assert np.abs(got["y"].reshape(8, D) - y_ref).max() <= 2e-3 * np.abs(gam).max()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [384, 65536])
def test_one_pass_softmax_on_gpu(D):
    from tests.rewrite.test_gpu_rewritten import _run_on_gpu
    one, trace = apply_one_pass(lowered(_softmax_model([8, D])))
    assert trace
    x, ref = _softmax_inputs((8, D), 1e4, seed=4)
    got = _run_on_gpu(one, {"x": x})["y"].reshape(8, D)
    assert np.abs(got - ref).max() <= 2e-6 * ref.max()


@pytest.mark.parametrize("D,want", [(65536, True), (1024, False)])
def test_search_keeps_the_one_pass_form_only_where_it_streams(D, want):
    """pipeline/search.py: the plan chosen for softmax over 512 x D uses the online rule exactly
    where its kernel streams the row."""
    from powerfusion.pipeline.search import choose_plan
    graph = import_model(_softmax_model([512, D]))
    (sub,) = partition_graph(graph, "cuda").subgraphs
    choice = choose_plan(sub, graph, "h200", cache=False, budget_s=1.0, beam=2)
    assert any(s.rule in ONEPASS_RULES for s in choice.trace) == want


@pytest.mark.parametrize("kind", ["softmax", "layernorm"])
def test_bfloat16_one_pass_matches_two_pass(kind):
    """bf16 rows are widened to float32 tiles (a cast between the load and the statistics): the
    shift row recomputes that cast; outputs agree with the two-pass form to one bf16 ulp."""
    import ml_dtypes
    bf, D = ml_dtypes.bfloat16, 4096
    if kind == "softmax":
        nodes, inits = [h.make_node("Softmax", ["x"], ["y"], axis=-1)], []
    else:
        nodes = [h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
        inits = [nh.from_array(np.ones(D, bf), "g"), nh.from_array(np.zeros(D, bf), "b")]
    gr = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", TP.BFLOAT16, [2, D])],
                      [h.make_tensor_value_info("y", TP.BFLOAT16, [2, D])], inits)
    m = h.make_model(gr, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    two = lowered(m)
    one, trace = apply_one_pass(two)
    assert trace
    x = (100 + np.random.default_rng(0).standard_normal((2, D))).astype(bf)
    a, b = (_run(g, {"x": x})["y"].astype(np.float32) for g in (two, one))
    np.testing.assert_allclose(b, a, rtol=2 ** -7, atol=2 ** -7 * np.abs(a).max())


@pytest.mark.parametrize("kind", ["softmax", "layernorm"])
def test_long_rows_are_streamed_once_per_statistic(kind, tmp_path):
    """The rendered CUDA kernel of a 65536-wide row: three streamed loops over the row (three
    reads of x) before the rule, two after (the statistics' pass, the output's pass); the
    one-pass source compiles (nvcc, where installed)."""
    import subprocess
    from powerfusion.backends.cuda.renderer import CUDARenderer
    model = _softmax_model([2, 65536]) if kind == "softmax" else _model("layernorm", [2, 65536])[0]
    two = lowered(model)
    one = apply_one_pass(two)[0]
    (before,), (after,) = CUDARenderer().render(two), CUDARenderer().render(one)
    assert before.source.count("for (int ri = 0;") == 3
    assert after.source.count("for (int ri = 0;") == 2
    nvcc = require_tool("nvcc")
    (tmp_path / "k.cu").write_text(after.source)
    subprocess.run([nvcc, "-arch=sm_90", "-c", str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.o")], check=True)
