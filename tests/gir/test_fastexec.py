"""The fast GIR executor (powerfusion/gir/fastexec.py) against the numpy interpreter.

Equality is exact (bit for bit) except where a graph sums or multiplies in a reduction:
numpy picks the summation order from the memory layout, and the interpreter's gathered
arrays have a different layout, so there the two agree to rounding (float32 rtol 1e-5,
float16 / bfloat16 one unit in the last place of the stored result). max / min reductions
are exact in any order and compared exactly. Every case also runs with no index budget and
tiny chunks, which sends every access through the run-time (chunked) path."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from powerfusion import basic as B
from powerfusion.gir.expr import I, J, Load, U
from powerfusion.gir.fastexec import FastProgram, run_fast
from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.ir import (Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel, Reduce,
                                Scope, Sync)
from powerfusion.templates.merge import lower_subgraph
from powerfusion.rewrite import optimise
from powerfusion.templates import TEMPLATES, candidates
from powerfusion.templates.common import buffer_names
from tests.rewrite.gen import merged_graphs
from tests.session_cases import small_model_names, small_model_session
from tests.templates.strategies import GraphBuilder, basic_cases

TOL = {"float32": (1e-5, 1e-6), "float64": (1e-12, 1e-12), "float16": (1e-3, 1e-3), "bfloat16": (8e-3, 8e-3)}


def _exact(g: GIRGraph) -> bool:
    return not any(isinstance(op.args, Reduce) and op.args.fn in ("sum", "prod") for op in g.ops)


def assert_same(g: GIRGraph, feeds: dict, label: str = "", chunk: int = 7) -> dict:
    """fastexec (prepared, and fully run-time in chunks of `chunk` elements) equals run_gir on `g`."""
    want = run_gir(g, feeds)
    runs = {"prepared": run_fast(g, feeds),
            "chunked": FastProgram(g, index_budget=0, chunk_elements=chunk).run(feeds)}
    for how, got in runs.items():
        assert set(got) == set(want)
        for name, w in want.items():
            x = got[name]
            assert x.dtype == w.dtype and x.shape == w.shape, f"{label} {how} {name}"
            if _exact(g) or w.dtype.kind not in "f" and w.dtype.name != "bfloat16":
                np.testing.assert_array_equal(x, w, err_msg=f"{label} {how} {name}")
            else:
                rtol, atol = TOL[w.dtype.name]
                np.testing.assert_allclose(x.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol,
                                           err_msg=f"{label} {how} {name}")
    return runs["prepared"]


# ---- random graphs ------------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(merged_graphs())
def test_generated_graphs_before_and_after_rewriting(case):
    g, feeds, _ = case
    assert_same(g, feeds, "merged")
    assert_same(optimise(g)[0], feeds, "rewritten")


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(basic_cases(max_ops=4, max_rank=3, max_dim=12, dtypes=("float32", "float16", "bfloat16")))
def test_lowered_basic_subgraphs(case):
    from powerfusion.backends.cpu.session import CPU_SESSION_TARGET
    for target in ("cuda", CPU_SESSION_TARGET):
        g = lower_subgraph(case.subgraph, case.graph, None, target)
        assert_same(g, case.feeds, "lowered")
        assert_same(optimise(g)[0], case.feeds, "rewritten")


# ---- every template family ------------------------------------------------------------

def _one(op, shapes, dtype="float32", extra=None):
    b = GraphBuilder("t", 0)
    ins = [b.input(f"x{k}", s, dtype) for k, s in enumerate(shapes)]
    if extra:
        ins += extra(b)
    b.op(op, ins)
    return b.build()


def _conv_case():
    b = GraphBuilder("c", 1)
    x = b.input("x", (1, 4, 6, 6))
    w = b.constant("w", np.random.default_rng(0).standard_normal((4, 1, 3, 3)).astype(np.float32))
    bias = b.constant("bias", np.arange(4, dtype=np.float32))
    b.op(B.Conv((1, 1), (1, 1), (1, 1), (1, 1), 4), [x, w, bias])
    return b.build()


def _conv_stencil_cases():
    """Stencil shapes: a 7x7 window over 7x7 planes (a group's rows cross planes, the last
    group is partly empty), and fp16 at stride 2 with dilation 2 and uneven padding."""
    out = []
    for shape, k, stride, pads, dil, dt in [((1, 3, 7, 7), 7, (1, 1), ((3, 3), (3, 3)), (1, 1), "float32"),
                                            ((2, 2, 11, 13), 3, (2, 2), ((2, 1), (1, 2)), (2, 2), "float16")]:
        b = GraphBuilder("c", 2)
        x = b.input("x", shape, dt)
        w = b.constant("w", np.random.default_rng(1).standard_normal((shape[1], 1, k, k)).astype(dt))
        b.op(B.Conv(stride, pads[0], pads[1], dil, shape[1]), [x, w])
        out.append(b.build())
    return out


def _involution_cases():
    """A 3x3 involution over 2 groups at stride 1 (rows of 8: flat strip, vector kernel loads) and
    a 5x5 one at stride 2 with dilation 2 (element loads)."""
    out = []
    for shape, k, g, s, d in [((2, 4, 6, 8), 3, 2, 1, 1), ((1, 4, 11, 13), 5, 4, 2, 2)]:
        p = d * (k - 1) // 2
        oh, ow = ((n + 2 * p - d * (k - 1) - 1) // s + 1 for n in shape[2:])
        b = GraphBuilder("inv", 3)
        x, kern = b.input("x", shape), b.input("kern", (shape[0], g, k * k, oh, ow))
        b.op(B.Involution((k, k), (s, s), (d, d), (p, p), (p, p)), [x, kern])
        out.append(b.build())
    return out


TEMPLATE_CASES = {  # one case (or more) per basic op kind that has templates, tails included
    B.Elementwise: [_one(B.Elementwise("add"), [(5, 70), (5, 70)]), _one(B.Elementwise("tanh"), [(6, 40)], "float16"),
                    _one(B.Elementwise("cast", (("to", np.dtype("float16")),)), [(4, 33)])],
    B.Broadcast: [_one(B.Broadcast((3, 5, 70)), [(5, 1)]), _one(B.Broadcast((33, 2)), [(1,)])],
    B.Reshape: [_one(B.Reshape((6, 72)), [(2, 3, 9, 8)])],
    B.Transpose: [_one(B.Transpose((2, 0, 1)), [(3, 5, 70)]), _one(B.Transpose((1, 0)), [(40, 33)], "bfloat16")],
    B.Slice: [_one(B.Slice((1, 2), (5, 60), (2, 3)), [(6, 70)])],
    B.Concat: [_one(B.Concat(1), [(3, 5), (3, 7)])],
    B.Pad: [_one(B.Pad((0, 1, -1, 2), (0, 0, 2, -2), "constant", 0.5), [(2, 3, 5, 7)]),
            _one(B.Pad((3,), (2,), "reflect", 0.0), [(40,)])],
    B.Gather: [_one(B.Gather(0), [(10, 7)], extra=lambda b: [b.input("i", (3, 2), "int64", -10, 10)])],
    B.GatherElements: [_one(B.GatherElements(1), [(4, 9)], extra=lambda b: [b.input("i", (4, 6), "int64", -9, 9)])],
    B.Window: [_one(B.Window((3, 3), (2, 1), (1, 2), (1, 1), (1, 0), -np.inf), [(2, 3, 9, 8)])],
    B.Reduce: [_one(B.Reduce("sum", (1,), False), [(6, 300)]), _one(B.Reduce("max", (0,), True), [(300, 6)]),
               _one(B.Reduce("sum", (0, 2), False), [(4, 6, 5)], "float16")],
    B.MatMul: [_one(B.MatMul(False, False), [(1, 40), (40, 24)]), _one(B.MatMul(True, False), [(40, 1), (40, 24)])],
    B.Conv: [_conv_case(), *_conv_stencil_cases()],
    B.Involution: _involution_cases(),
}


def test_template_cases_cover_every_op_kind_with_templates():
    assert set(TEMPLATE_CASES) == set(TEMPLATES)


@pytest.mark.parametrize("kind", list(TEMPLATE_CASES), ids=lambda k: k.__name__)
def test_every_template_candidate(kind):
    families = set()
    for case in TEMPLATE_CASES[kind]:
        g = case.graph
        node = g.nodes[-1]
        names = buffer_names(list(g.tensors))
        feeds = {names[t]: v for t, v in case.feeds.items()}
        for target in ("cuda", "cpu"):
            for c in candidates(node, g.tensors, target, names):
                families.add(c.name)
                assert_same(c.build(), feeds, c.label)
    assert families


# ---- hand-written corners -------------------------------------------------------------

F32 = "float32"


def _graph(ops, buffers, inputs, outputs, units=4, upg=2, lanes=4):
    return GIRGraph("t", Parallel(units, upg, lanes), tuple(buffers), tuple(ops), tuple(inputs), tuple(outputs))


def _reg(name, num, width, valid=None, fill=0.0):
    return MemorySlice(name, Level.REGISTER, I * width + J, num, width, F32, 1, valid, fill)


def test_register_data_across_a_kernel_boundary_reads_poison():
    x, y = Buffer("x", Level.GLOBAL, 8, F32), Buffer("y", Level.GLOBAL, 8, F32)
    r = Buffer("r", Level.REGISTER, 2, F32)
    g = _graph([GOp(Move(), (MemorySlice("x", Level.GLOBAL, U * 2 + J, 1, 2, F32),), (_reg("r", 1, 2),)),
                GOp(Sync(Scope.DEVICE), (), ()),
                GOp(Move(), (_reg("r", 1, 2),), (MemorySlice("y", Level.GLOBAL, U * 2 + J, 1, 2, F32),))],
               [x, y, r], ["x"], ["y"])
    out = assert_same(g, {"x": np.arange(8, dtype=np.float32)})
    assert np.isnan(out["y"]).all()


def test_shared_tile_with_block_sync_and_masked_tail():
    """Units of a group exchange data through a shared tile across a BLOCK barrier (a no-op in
    lockstep); the last unit's tail is masked, so its view reaches into padding."""
    n = 13
    x, y = Buffer("x", Level.GLOBAL, n, F32), Buffer("y", Level.GLOBAL, n, F32)
    sh = Buffer("s", Level.SHARED, 8, F32)
    valid = (U * 4 + J).lt(n)
    load = MemorySlice("x", Level.GLOBAL, U * 4 + J, 1, 4, F32, valid=valid, fill=-1.0)
    to_sh = MemorySlice("s", Level.SHARED, (U % 2) * 4 + J, 1, 4, F32)
    swapped = MemorySlice("s", Level.SHARED, (1 - U % 2) * 4 + J, 1, 4, F32)
    store = MemorySlice("y", Level.GLOBAL, U * 4 + J, 1, 4, F32, valid=valid)
    g = _graph([GOp(Move(), (load,), (to_sh,)), GOp(Sync(Scope.BLOCK), (to_sh,), (swapped,)),
                GOp(Move(), (swapped,), (store,))], [x, y, sh], ["x"], ["y"])
    prog = FastProgram(g)
    assert prog.pad["x"][1] > 0  # the masked tail became padding, not an index array
    out = assert_same(g, {"x": np.arange(n, dtype=np.float32)})
    np.testing.assert_array_equal(out["y"], [4, 5, 6, 7, 0, 1, 2, 3, 12, -1, -1, -1, 8])  # partners swapped


def test_gather_and_data_dependent_guard_run_chunked():
    """Loads in an index and in a guard are evaluated at run time (the dynamic path)."""
    table, ids, y = Buffer("T", Level.GLOBAL, 40, F32), Buffer("ids", Level.GLOBAL, 4, "int64"), Buffer("y", Level.GLOBAL, 40, F32)
    src = MemorySlice("T", Level.GLOBAL, Load("ids", U) * 10 + J, 1, 10, F32)
    dst = MemorySlice("y", Level.GLOBAL, U * 10 + J, 1, 10, F32)
    g = _graph([GOp(Move(), (src,), (dst,), guard=Load("ids", U).lt(3))], [table, ids, y], ["T", "ids"], ["y"])
    prog = FastProgram(g)
    assert all(s.dynamic for s in prog.steps)
    feeds = {"T": np.arange(40, dtype=np.float32), "ids": np.array([3, 0, 2, 1])}
    out = assert_same(g, feeds)
    np.testing.assert_array_equal(out["y"][10:20], np.arange(10, dtype=np.float32))
    assert np.isnan(out["y"][:10]).all()  # unit 0's guard is false: never written


def test_repeated_addresses_last_write_wins():
    x, y = Buffer("x", Level.GLOBAL, 8, F32), Buffer("y", Level.GLOBAL, 2, F32)
    g = _graph([GOp(Move(), (MemorySlice("x", Level.GLOBAL, U * 2 + J, 1, 2, F32),),
                    (MemorySlice("y", Level.GLOBAL, J, 1, 2, F32),))], [x, y], ["x"], ["y"])
    out = assert_same(g, {"x": np.arange(8, dtype=np.float32)})
    np.testing.assert_array_equal(out["y"], [6, 7])


def test_out_of_bounds_slice_is_an_index_error():
    x, y = Buffer("x", Level.GLOBAL, 7, F32), Buffer("y", Level.GLOBAL, 8, F32)
    g = _graph([GOp(Move(), (MemorySlice("x", Level.GLOBAL, U * 2 + J, 1, 2, F32),),
                    (MemorySlice("y", Level.GLOBAL, U * 2 + J, 1, 2, F32),))], [x, y], ["x"], ["y"])
    with pytest.raises(IndexError, match="outside buffer 'x'"):
        run_gir(g, {"x": np.zeros(7, np.float32)})
    with pytest.raises(IndexError, match="outside buffer 'x'"):
        run_fast(g, {"x": np.zeros(7, np.float32)})


def test_inputs_are_not_modified_and_outputs_are_fresh():
    x, y = Buffer("x", Level.GLOBAL, 8, F32), Buffer("y", Level.GLOBAL, 8, F32)
    r = Buffer("r", Level.REGISTER, 2, F32)
    glob = MemorySlice("x", Level.GLOBAL, U * 2 + J, 1, 2, F32)
    g = _graph([GOp(Move(), (glob,), (_reg("r", 1, 2),)),
                GOp(Elementwise("neg"), (_reg("r", 1, 2),), (_reg("r", 1, 2),)),
                GOp(Move(), (_reg("r", 1, 2),), (MemorySlice("y", Level.GLOBAL, U * 2 + J, 1, 2, F32),))],
               [x, y, r], ["x"], ["y"])
    prog, feed = FastProgram(g), np.arange(8, dtype=np.float32)
    a, b = prog.run({"x": feed})["y"], prog.run({"x": feed})["y"]
    np.testing.assert_array_equal(a, -feed)
    assert a is not b and not np.shares_memory(a, b)
    np.testing.assert_array_equal(feed, np.arange(8))
    assert "r" not in prog.poisoned  # every register read follows a write: no poison fill needed


def test_large_accesses_are_analysed_in_chunks_and_stay_views():
    """Beyond chunk_elements an access is checked chunk by chunk; an unmasked affine one is
    still a strided view, anything else is left to the run-time path."""
    n = 64
    x, y = Buffer("x", Level.GLOBAL, n, F32), Buffer("y", Level.GLOBAL, n, F32)
    r = Buffer("r", Level.REGISTER, 4, F32)
    g = _graph([GOp(Move(), (MemorySlice("x", Level.GLOBAL, U * 4 + J, 1, 4, F32),), (_reg("r", 1, 4),)),
                GOp(Elementwise("exp"), (_reg("r", 1, 4),), (_reg("r", 1, 4),)),
                GOp(Move(), (_reg("r", 1, 4),), (MemorySlice("y", Level.GLOBAL, (U % 4) * 16 + (U // 4) * 4 + J,
                                                                 1, 4, F32),))], [x, y, r], ["x"], ["y"], units=16)
    prog = FastProgram(g, chunk_elements=9)
    kinds = [[a.affine is not None for a in st.inputs + st.outputs] for st in prog.steps]
    assert kinds == [[True, True], [True, True], [True, False]]
    feed = np.linspace(-1, 1, n, dtype=np.float32)
    want = run_gir(g, {"x": feed})["y"]
    np.testing.assert_array_equal(prog.run({"x": feed})["y"], want)


# ---- the committed small models: every rewritten subgraph the CPU session runs ------------

@pytest.mark.parametrize("name", small_model_names())
def test_committed_model_subgraphs(name):
    sess, feeds = small_model_session(name, "cpu-reference")
    env = sess.run_all_tensors(feeds)
    kernels = sess.cpu_plan.kernels
    assert kernels and all(k.path == "gir" for k in kernels.values()), sess.fallbacks
    for k in kernels.values():
        g = k.gir
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = assert_same(g, {b: env[t] for b, t in k.inputs}, k.subgraph.name, chunk=1 << 12)
        for b, t in k.outputs:  # and what the session stored is what fastexec computes
            np.testing.assert_array_equal(got[b].reshape(env[t].shape), env[t])
