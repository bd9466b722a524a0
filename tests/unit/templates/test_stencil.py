"""conv.depthwise.stencil: numerics against numpy (float64 reference), the staged tile's shape
and traffic against the gather template, and the plan it gives once merged and rewritten.

Tolerances (|got - want| <= atol + rtol |want|): float32 1e-5 / 1e-5 (the window is summed in
another order than numpy's); float16 2e-3 / 2e-3 (inputs and weights are fp16 values, the sum
is taken in float32 and rounded once to fp16: half an ulp, 4.9e-4 relative, plus the order).
"""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion import basic as B
from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.ir import Level, Scope, Sync
from powerfusion.gir.traffic import traffic
from powerfusion.gir.verifier import verify
from powerfusion.templates import buffer_names, candidates
from tests.templates.strategies import GraphBuilder

TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3)}


def conv_case(shape, k, stride=(1, 1), pads=None, dil=(1, 1), mult=1, dtype="float32", bias=True, seed=0):
    n, c, h, w = shape
    pads = pads if pads is not None else ((k // 2, k // 2), (k // 2, k // 2))
    b = GraphBuilder("dw", seed)
    x = b.input("x", shape, dtype)
    wt = b.input("w", (c * mult, 1, k, k), dtype)
    ins = [x, wt] + ([b.input("bias", (c * mult,), dtype)] if bias else [])
    b.op(B.Conv(stride, pads[0], pads[1], dil, c), ins)
    return b.build(), b.values


def numpy_depthwise(x, w, bias, stride, pads, dil):
    """Direct float64 depthwise convolution (group = channels, multiplier Cout / C)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, h, wd = x.shape
    cout, _, kh, kw = w.shape
    mult = cout // c
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0][0], pads[1][0]), (pads[0][1], pads[1][1])))
    oh = (h + pads[0][0] + pads[1][0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + pads[0][1] + pads[1][1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((n, cout, oh, ow))
    for co in range(cout):
        for a in range(kh):
            for b_ in range(kw):
                r0, c0 = a * dil[0], b_ * dil[1]
                win = xp[:, co // mult, r0:r0 + stride[0] * (oh - 1) + 1:stride[0], c0:c0 + stride[1] * (ow - 1) + 1:stride[1]]
                y[:, co] += win * w[co, 0, a, b_]
    if bias is not None:
        y += bias.astype(np.float64)[None, :, None, None]
    return y


def stencil_candidates(case, target="cuda"):
    g, _ = case
    node = g.graph.nodes[-1]
    return [c for c in candidates(node, g.graph.tensors, target, buffer_names(list(g.graph.tensors)))
            if c.name == "conv.depthwise.stencil"]


CASES = {   # id: (shape, k, stride, pads, dilation, multiplier, dtype)
    "3x3": ((2, 4, 9, 8), 3, (1, 1), None, (1, 1), 1, "float32"),
    "3x3-s2-uneven-pad": ((2, 4, 9, 8), 3, (2, 2), ((1, 0), (1, 1)), (1, 1), 1, "float32"),
    "5x5-wide-rows": ((1, 2, 10, 70), 5, (1, 1), None, (1, 1), 1, "float32"),
    "7x7-planes-cross-groups": ((1, 3, 7, 7), 7, (1, 1), None, (1, 1), 1, "float32"),
    "7x7-14x14": ((1, 5, 14, 14), 7, (1, 1), None, (1, 1), 1, "float32"),
    "3x3-dilated": ((1, 3, 12, 12), 3, (1, 1), ((2, 2), (2, 2)), (2, 2), 1, "float32"),
    "3x3-multiplier-2": ((2, 3, 6, 6), 3, (1, 1), None, (1, 1), 2, "float32"),
    "3x3-no-padding-s2": ((1, 4, 11, 13), 3, (2, 1), ((0, 0), (0, 0)), (1, 1), 1, "float32"),
    "7x7-fp16": ((1, 4, 14, 14), 7, (1, 1), None, (1, 1), 1, "float16"),
    "5x5-s2-fp16": ((2, 2, 11, 13), 5, (2, 2), ((2, 1), (1, 2)), (1, 1), 1, "float16"),
}


def case_of(spec):
    """(conv_case, (stride, pads, dilation, dtype)) of a CASES entry (shape, k, stride, pads,
    dilation, multiplier, dtype); pads None: k // 2 each side."""
    shape, k, stride, pads, dil, mult, dtype = spec
    pads = pads if pads is not None else ((k // 2, k // 2), (k // 2, k // 2))
    return conv_case(shape, k, stride, pads, dil, mult, dtype), (stride, pads, dil, dtype)


def assert_candidates_match_numpy(cid, spec, pick):
    """Every candidate `pick(case)` offers for the case `spec` verifies and, run by the
    interpreter, matches the float64 numpy depthwise conv within the dtype's tolerance."""
    case, (stride, pads, dil, dtype) = case_of(spec)
    g, values = case
    names = buffer_names(list(g.graph.tensors))
    node = g.graph.nodes[-1]
    want = numpy_depthwise(values["x"], values["w"], values["bias"], stride, pads, dil)
    cands = pick(case)
    assert cands, f"no candidate for {cid}"
    assert_each_matches(cands, node, names, values, want, TOL[dtype])


def assert_each_matches(cands, node, names, values, want, tol) -> None:
    """Each candidate's graph verifies and, run by the interpreter on `values`, gives `want`
    (float64) within tol = (rtol, atol)."""
    for c in cands:
        gir = c.build()
        verify(gir)
        got = run_gir(gir, {names[t]: values[t] for t in node.inputs})[names[node.outputs[0]]]
        np.testing.assert_allclose(got.astype(np.float64).reshape(want.shape), want, rtol=tol[0], atol=tol[1],
                                   err_msg=c.label)


@pytest.mark.parametrize("cid", list(CASES))
def test_stencil_matches_numpy(cid):
    assert_candidates_match_numpy(cid, CASES[cid], stencil_candidates)


def test_stencil_stages_each_row_once_per_group():
    """Expected form of a 7x7 conv over 14x14 planes (rows layout): one SHARED tile, one BLOCK
    sync between staging and the window reads, one kernel; x is read from GLOBAL once per tile
    slot (padding included), the gather template once per window tap (49 times)."""
    case = conv_case((1, 8, 14, 14), 7)
    rows = next(c for c in stencil_candidates(case) if c.params.layout == "rows").build()
    shared = [b for b in rows.buffers if b.level == Level.SHARED]
    assert len(shared) == 1
    syncs = [op for op in rows.ops if isinstance(op.args, Sync)]
    assert [s.args.scope for s in syncs] == [Scope.BLOCK]
    assert len(rows.kernels()) == 1
    # 4 rows per group (one unit per row); a group crossing planes reads rows 12, 13 of one
    # plane and 0, 1 of the next: 16 virtual rows of 20 padded columns
    assert shared[0].size == 16 * 20
    g, _ = case
    node = g.graph.nodes[-1]
    cols = next(c for c in candidates(node, g.graph.tensors, "cuda", buffer_names(list(g.graph.tensors)))
                if c.name == "conv.depthwise.cols").build()
    x_bytes = 8 * 14 * 14 * 4

    def x_reads(gir):
        return sum(s.count * len(op.active_units(gir.parallel.units)) * 4 for op in gir.ops for s in op.inputs
                   if s.level == Level.GLOBAL and s.buffer == "x")
    assert x_reads(cols) >= 40 * x_bytes          # 49 taps, the padding masked
    # 28 groups, each staging its 320-element tile in 3 warp-wide segments per unit
    assert rows.parallel.units == 8 * 14 and x_reads(rows) == 28 * 3 * 4 * 32 * 4
    assert traffic(rows).get("global", 0) < traffic(cols).get("global", 0) / 5


def test_stencil_flat_layout_for_narrow_rows_only():
    narrow = {c.params.layout for c in stencil_candidates(conv_case((1, 4, 7, 7), 7))}
    wide = {c.params.layout for c in stencil_candidates(conv_case((1, 4, 40, 40), 3))}
    assert narrow == {"rows", "flat"} and wide == {"rows"}


def test_stencil_declines_a_tile_beyond_shared_memory():
    """A 2-D conv whose rows are too long for the tile budget gets no stencil candidate."""
    assert stencil_candidates(conv_case((1, 2, 8, 4000), 7)) == []


def test_stencil_on_other_targets():
    for target in ("hip", "cpu"):
        assert stencil_candidates(conv_case((1, 3, 9, 9), 3), target)


def _dwconv_model(c, hw, k, bn_silu=False):
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((c, 1, k, k)) / k).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if bn_silu else "y"], group=c, kernel_shape=[k, k],
                              pads=[k // 2] * 4)]
    if bn_silu:
        for name in ("sc", "bi", "mu"):
            inits.append(numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), name))
        inits.append(numpy_helper.from_array((rng.random(c) + 0.5).astype(np.float32), "var"))
        nodes += [helper.make_node("BatchNormalization", ["c", "sc", "bi", "mu", "var"], ["n"], epsilon=1e-5),
                  helper.make_node("Sigmoid", ["n"], ["s"]), helper.make_node("Mul", ["n", "s"], ["y"])]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, c, hw, hw]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "dw", vi[:1], vi[1:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("c,hw,want", [(768, 7, "conv.depthwise.stencil(layout=flat, vec=1)"),
                                       (384, 14, "conv.depthwise.stencil(layout=flat, vec=1)"),
                                       (192, 28, "conv.depthwise.strip(layout=flat, vec=4)"),
                                       (96, 56, "conv.depthwise.strip(layout=flat, vec=4)")])
def test_search_picks_the_stencil_for_convnext_layers(c, hw, want):
    """ConvNeXt-T's 7x7 depthwise convs on H200 (benchmarks/results/gir-dwconv.md): the template
    that measured fastest, one kernel -- the flat stencil at 768x7x7 (2.9 us; cols 4.1) and
    384x14x14 (3.4; cols 4.2), the flat strip at 192x28x28 (3.2; stencil 4.6, cols 4.7) and
    96x56x56 (5.8; cols 7.7, stencil 8.8)."""
    from powerfusion.compiler import compile_model
    steps = compile_model(_dwconv_model(c, hw, 7), "h200").kernel_steps
    assert len(steps) == 1 and len(steps[0].gir.kernels()) == 1
    assert [t for _, t in steps[0].gir.templates] == [want]


def test_idle_lanes_cost_issue_slots():
    """The cost model charges a warp-wide access for its idle lanes: at 768x7x7 the gather
    template (one unit per 7-wide row) is predicted slower than the flattened stencil."""
    from powerfusion.perfmodel.cost import estimate, predict_seconds
    case = conv_case((1, 768, 7, 7), 7)
    g, _ = case
    node = g.graph.nodes[-1]
    by = {c.label: c.build() for c in candidates(node, g.graph.tensors, "h200", buffer_names(list(g.graph.tensors)))}
    t = {k: predict_seconds(estimate(v, "h200"), "h200") for k, v in by.items()}
    flat = t["conv.depthwise.stencil(layout=flat, vec=1)"]
    assert flat < t["conv.depthwise.cols(style=cols, vec=1, split=1, rows=1)"]
    assert "load/store issue" in estimate(by["conv.depthwise.cols(style=cols, vec=1, split=1, rows=1)"], "h200").limits


def test_flat_stencil_with_batchnorm_and_silu_is_one_kernel_and_matches_numpy():
    """ConvNeXt-T's 384x14x14 7x7 depthwise conv + BatchNormalization + SiLU as the search plans
    it for H200: the flat stencil with the BatchNorm and SiLU in its kernel, the plan's GIR run
    by the interpreter against numpy in float64 (float32 tolerance 1e-4: BN and SiLU on top)."""
    from onnx import numpy_helper
    from powerfusion.compiler import compile_model
    model = _dwconv_model(384, 14, 7, bn_silu=True)
    step = compile_model(model, "h200").kernel_steps[0]
    gir = step.gir
    assert len(gir.kernels()) == 1
    assert [t for _, t in gir.templates][0] == "conv.depthwise.stencil(layout=flat, vec=1)"
    init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    x = np.random.default_rng(9).standard_normal((1, 384, 14, 14)).astype(np.float32)
    feeds = {b: x for b in gir.inputs if step.buffers[b] == "x"}
    feeds |= {b: numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == step.buffers[b]))
              for b in gir.inputs if b not in feeds}
    got = run_gir(gir, feeds)[next(b for b in gir.outputs if step.buffers[b] == "y")].reshape(x.shape)
    conv = numpy_depthwise(x, init["w"].astype(np.float32), init["b"], (1, 1), ((3, 3), (3, 3)), (1, 1))
    col = {k: init[k][None, :, None, None] for k in ("sc", "bi", "mu", "var")}
    bn = (conv - col["mu"]) / np.sqrt(col["var"] + 1e-5) * col["sc"] + col["bi"]
    np.testing.assert_allclose(got, bn / (1 + np.exp(-bn)), rtol=1e-4, atol=1e-4)
