"""Run template candidates and lowered graphs through the verifier and the numpy interpreter,
and compare with the basic graph's numpy reference."""
from __future__ import annotations

import numpy as np

from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.verifier import verify
from powerfusion.templates import buffer_names, candidates

# Tolerances per output dtype. float32: the templates sum in a different order than numpy
# (lanes, segments, partials), so a few ulps of the row sums. fp16/bf16: both sides compute
# in float32 and round once; a different summation order can flip the last bit.
TOL = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def assert_close(got: np.ndarray, want: np.ndarray, what: str):
    name = np.dtype(want.dtype).name
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if name in TOL:
        rtol, atol = TOL[name]
        g, w = got.astype(np.float64), want.astype(np.float64)
        ok = np.isclose(g, w, rtol=rtol, atol=atol) | (np.isinf(g) & np.isinf(w) & (np.sign(g) == np.sign(w)))
        assert ok.all(), f"{what}: max error {np.nanmax(np.abs(g - w))} at {np.argwhere(~ok)[0]}"
    else:
        assert np.array_equal(got, want), f"{what}: values differ"


def check_node_candidates(case, target="cuda", expect_templates=()) -> list:
    """Every candidate of the case's last node: verifies, and matches the reference."""
    g = case.graph
    node = g.nodes[-1]
    names = buffer_names(list(g.tensors))
    ref = case.reference()
    # intermediate tensors of the case are fed from the reference run of the prefix
    from powerfusion.frontend.numpy_exec import EXECUTORS
    env = dict(case.feeds) | dict(g.constants)
    for n in g.nodes[:-1]:
        env[n.outputs[0]] = np.asarray(EXECUTORS[type(n.op)](n.op, [env[t] for t in n.inputs],
                                                              g.tensors[n.outputs[0]].dtype)).astype(
            g.tensors[n.outputs[0]].dtype).reshape(g.tensors[n.outputs[0]].shape)
    cands = candidates(node, g.tensors, target, names)
    assert cands, f"no candidates for {node}"
    got_names = {c.name for c in cands}
    for t in expect_templates:
        assert t in got_names, f"template {t} missing; got {sorted(got_names)}"
    out_t = node.outputs[0]
    want = ref[out_t] if out_t in ref else None
    if want is None:
        want = np.asarray(EXECUTORS[type(node.op)](node.op, [env[t] for t in node.inputs], g.tensors[out_t].dtype))
        want = want.astype(g.tensors[out_t].dtype).reshape(g.tensors[out_t].shape)
    for c in cands:
        gir = c.build()
        verify(gir)
        feeds = {names[t]: env[t] for t in node.inputs}
        got = run_gir(gir, feeds)[names[out_t]].reshape(g.tensors[out_t].shape)
        assert_close(got, want, f"{c.label} for {node.op}")
    return cands


def check_lowered(case, gir):
    verify(gir)
    out = run_gir(gir, dict(case.feeds))
    ref = case.reference()
    by_name = {}
    for t in case.subgraph.outputs:
        got = out[_buffer_of(gir, t)].reshape(case.graph.tensors[t].shape)
        assert_close(got, ref[t], f"output {t} of {gir.name}")
        by_name[t] = got
    return by_name


def _buffer_of(gir, tensor):
    from powerfusion.templates.common import sanitize
    s = sanitize(tensor)
    assert s in gir.outputs, f"{tensor} not an output of {gir.name}: {gir.outputs}"
    return s
