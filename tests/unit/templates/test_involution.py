"""Involution templates (involution.stencil, .strip, .cols, .dot): every candidate verifies and, run by the
GIR interpreter, matches a float64 numpy involution; the stencil stages each input row once per
group, as the depthwise conv's does.

Tolerances (|got - want| <= atol + rtol |want|): float32 1e-5 / 1e-5 (the window is summed in
another order than numpy's); float16 2e-3 / 2e-3 (fp16 inputs, float32 sum rounded once to fp16).
"""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion import basic as B
from powerfusion.frontend.numpy_exec import run_involution
from powerfusion.gir.ir import Level, Scope, Sync
from powerfusion.templates import buffer_names, candidates
from tests.templates.strategies import GraphBuilder
from tests.unit.templates.test_stencil import assert_each_matches

TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3)}


def _out(h, k, s, d, pb, pe):
    return (h + pb + pe - d * (k - 1) - 1) // s + 1


def involution_case(shape, k, groups, stride=1, dil=1, pads=None, dtype="float32", seed=0):
    n, c, h, w = shape
    pb, pe = pads if pads is not None else (dil * (k - 1) // 2, dil * (k - 1) // 2)
    oh, ow = _out(h, k, stride, dil, pb, pe), _out(w, k, stride, dil, pb, pe)
    b = GraphBuilder("inv", seed)
    x = b.input("x", shape, dtype)
    kern = b.input("kern", (n, groups, k * k, oh, ow), dtype)
    op = B.Involution((k, k), (stride, stride), (dil, dil), (pb, pb), (pe, pe))
    b.op(op, [x, kern])
    return b.build(), b.values, op


def numpy_involution(x, kern, op: B.Involution):
    """Direct float64 loops over the taps (independent of numpy_exec's window view)."""
    x, kern = x.astype(np.float64), kern.astype(np.float64)
    n, c, h, w = x.shape
    g, _, oh, ow = kern.shape[1:]
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = op.kernel, op.strides, op.dilations, op.pad_begins
    xp = np.pad(x, ((0, 0), (0, 0), (ph, op.pad_ends[0]), (pw, op.pad_ends[1])))
    y = np.zeros((n, c, oh, ow))
    for ci in range(c):
        for a in range(kh):
            for b_ in range(kw):
                win = xp[:, ci, a * dh:a * dh + sh * (oh - 1) + 1:sh, b_ * dw:b_ * dw + sw * (ow - 1) + 1:sw]
                y[:, ci] += win * kern[:, ci // (c // g), a * kw + b_]
    return y


CASES = {   # id: (shape, k, groups, stride, dilation, dtype)
    "3x3-g4": ((2, 16, 9, 8), 3, 4, 1, 1, "float32"),
    "7x7-g2": ((1, 8, 14, 14), 7, 2, 1, 1, "float32"),
    "7x7-s2": ((1, 8, 16, 16), 7, 2, 2, 1, "float32"),
    "3x3-wide-rows": ((1, 4, 6, 70), 3, 1, 1, 1, "float32"),
    "3x3-dilated": ((1, 4, 12, 12), 3, 4, 1, 2, "float32"),
    "3x3-fp16": ((2, 8, 10, 10), 3, 2, 1, 1, "float16"),
}


@pytest.mark.parametrize("cid", list(CASES))
def test_involution_candidates_match_numpy(cid):
    shape, k, groups, stride, dil, dtype = CASES[cid]
    g, values, op = involution_case(shape, k, groups, stride, dil, dtype=dtype)
    names = buffer_names(list(g.graph.tensors))
    node = g.graph.nodes[-1]
    want = numpy_involution(values["x"], values["kern"], op)
    wide = [values["x"].astype(np.float64), values["kern"].astype(np.float64)]   # the reference executor
    np.testing.assert_allclose(run_involution(op, wide, np.float64), want, rtol=1e-12, atol=1e-12)
    cands = candidates(node, g.graph.tensors, "cuda", names)
    assert {c.name for c in cands} >= {"involution.stencil", "involution.cols"}
    assert "involution.strip" in {c.name for c in cands} or shape[3] % 4   # vector chunks of rows
    assert_each_matches(cands, node, names, values, want, TOL[dtype])


def test_involution_stencil_stages_rows_once():
    """One SHARED tile, one BLOCK sync between staging and the window reads, one kernel; the
    per-position kernel is read from GLOBAL as vectors along the output row."""
    g, _, _ = involution_case((1, 8, 14, 14), 7, 2)
    node = g.graph.nodes[-1]
    st = next(c for c in candidates(node, g.graph.tensors, "cuda", buffer_names(list(g.graph.tensors)))
              if c.name == "involution.stencil" and c.params.layout == "rows").build()
    assert len([b for b in st.buffers if b.level == Level.SHARED]) == 1
    assert [op.args.scope for op in st.ops if isinstance(op.args, Sync)] == [Scope.BLOCK]
    assert len(st.kernels()) == 1
