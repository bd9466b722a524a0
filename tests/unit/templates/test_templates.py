"""Every template x its parameter points x a few shapes (tails included): the verifier
accepts the graph and the interpreter reproduces the numpy reference of the basic op."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.errors import NodeError
from powerfusion import basic as B
from powerfusion.gir.ir import Level, Scope, Sync
from tests.templates.helpers import check_node_candidates
from tests.templates.strategies import GraphBuilder


def one(op, shapes, dtype="float32", extra=None, seed=0):
    b = GraphBuilder("t", seed)
    ins = [b.input(f"x{k}", s, dtype) for k, s in enumerate(shapes)]
    if extra:
        ins += extra(b)
    b.op(op, ins)
    return b.build()


@pytest.mark.parametrize("shape", [(5, 70), (3, 4, 64), (1000,), (7, 1), (2, 3, 1)])
@pytest.mark.parametrize("fn", ["add", "mul", "max"])
def test_elementwise_binary(shape, fn):
    check_node_candidates(one(B.Elementwise(fn), [shape, shape]),
                          expect_templates=["elementwise.chunk"] if np.prod(shape) > 1 else ())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_elementwise_low_precision(dtype):
    cands = check_node_candidates(one(B.Elementwise("tanh"), [(6, 40)], dtype))
    g = cands[0].build()
    regs = [b for b in g.buffers if b.level == Level.REGISTER]
    assert regs and all(b.dtype == "float32" for b in regs)  # loads widen, stores narrow
    assert any(v > 1 for v in (c.params.vec for c in cands))   # 16-byte lane accesses offered


def test_elementwise_cast_and_compare():
    check_node_candidates(one(B.Elementwise("cast", (("to", np.dtype("float16")),)), [(4, 33)]))
    check_node_candidates(one(B.Elementwise("less"), [(4, 33), (4, 33)]))
    check_node_candidates(_where_case())


def _where_case():
    b = GraphBuilder("w")
    c = b.input("c", (3, 20), "bool")
    x, y = b.input("x", (3, 20)), b.input("y", (3, 20))
    b.op(B.Elementwise("where"), [c, x, y])
    return b.build()


@pytest.mark.parametrize("src,dst", [((5, 1), (3, 5, 70)), ((70,), (4, 70)), ((1,), (33, 2)), ((2, 1, 3), (2, 5, 3))])
def test_broadcast(src, dst):
    check_node_candidates(one(B.Broadcast(dst), [src]))


@pytest.mark.parametrize("shape,perm", [((3, 5, 70), (2, 0, 1)), ((40, 33), (1, 0)), ((2, 3, 4, 8), (0, 2, 1, 3)),
                                        ((2, 2, 3, 5, 6), (0, 2, 1, 3, 4))])
def test_transpose(shape, perm):
    need = ["transpose.direct_out.rows", "transpose.direct_in.rows"]
    if perm[-1] != len(perm) - 1:
        need.append("transpose.tiled")
    cands = check_node_candidates(one(B.Transpose(perm), [shape]), expect_templates=need)
    tiled = [c for c in cands if c.name == "transpose.tiled"]
    for c in tiled:  # through a shared tile with a block barrier
        g = c.build()
        assert any(b.level == Level.SHARED for b in g.buffers)
        assert any(isinstance(o.args, Sync) and o.args.scope == Scope.BLOCK for o in g.ops)


@pytest.mark.parametrize("shape,axes,keep", [((3, 5, 70), (2,), True), ((3, 5, 70), (0, 1), False),
                                             ((6, 300), (1,), False), ((300, 6), (0,), True),
                                             ((4, 6, 5), (1,), True), ((4, 6, 5), (0, 2), False),
                                             ((1000,), (0,), False)])
@pytest.mark.parametrize("fn", ["sum", "max"])
def test_reduce(shape, axes, keep, fn):
    cands = check_node_candidates(one(B.Reduce(fn, axes, keep), [shape]),
                                  expect_templates=["reduce.row_warp", "reduce.block", "reduce.grid"])
    styles = {c.name: c.build() for c in cands}
    assert any(isinstance(o.args, Sync) and o.args.scope == Scope.DEVICE for o in styles["reduce.grid"].ops)
    assert any(isinstance(o.args, Sync) and o.args.scope == Scope.BLOCK for o in styles["reduce.block"].ops)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduce_low_precision(dtype):
    check_node_candidates(one(B.Reduce("sum", (1,), True), [(5, 130)], dtype))


def test_reduce_wide_block_for_long_rows():
    """Rows from WIDE_ROW elements also get a block of WIDE_GROUP units (16384 elements: 32 per
    lane), with the rows maps to match."""
    from powerfusion.templates.maps import WIDE_GROUP, WIDE_ROW
    cands = check_node_candidates(one(B.Reduce("sum", (1,), True), [(3, WIDE_ROW + 100)]))
    wide = [c for c in cands if c.name == "reduce.block" and c.params.group == WIDE_GROUP]
    assert wide and all(c.build().parallel.units_per_group == WIDE_GROUP for c in wide)
    short = check_node_candidates(one(B.Reduce("sum", (1,), True), [(3, 1000)]))
    assert not any(c.params.group for c in short if c.name == "reduce.block")
    maps = check_node_candidates(one(B.Elementwise("exp"), [(2, WIDE_ROW)]))
    assert any(getattr(c.params, "per_row", 1) == WIDE_GROUP for c in maps)


def test_reduce_min_prod():
    check_node_candidates(one(B.Reduce("min", (1,), True), [(5, 77)]))
    check_node_candidates(one(B.Reduce("prod", (0,), False), [(6, 9)], seed=3))


@pytest.mark.parametrize("shape,starts,stops,steps", [((4, 6, 10), (1, 0, 9), (3, 6, None), (1, 2, -3)),
                                                      ((8, 40), (0, 5), (8, 37), (1, 1)),
                                                      ((2, 6, 4, 4), (0, 3, 0, 0), (2, 6, 4, 4), (1, 1, 1, 1))])
def test_slice(shape, starts, stops, steps):
    check_node_candidates(one(B.Slice(starts, stops, steps), [shape]))


@pytest.mark.parametrize("a,b,axis", [((2, 3, 5, 7), (2, 4, 5, 7), 1), ((3, 40), (3, 9), 1), ((5, 8), (2, 8), 0)])
def test_concat(a, b, axis):
    check_node_candidates(one(B.Concat(axis), [a, b]), expect_templates=["concat.by_input.chunk"])


@pytest.mark.parametrize("mode,value", [("constant", 1.5), ("edge", 0.0), ("reflect", 0.0)])
def test_pad(mode, value):
    check_node_candidates(one(B.Pad((0, 1, -1, 2), (0, 0, 2, -2), mode, value), [(2, 3, 5, 7)]))
    check_node_candidates(one(B.Pad((3,), (2,), mode, value), [(40,)]))


def test_gather():
    check_node_candidates(one(B.Gather(0), [(10, 7)], extra=lambda b: [b.input("i", (3, 2), "int64", -10, 10)]))
    check_node_candidates(one(B.Gather(1), [(4, 50)], extra=lambda b: [b.input("i", (5,), "int64", -50, 50)]))
    check_node_candidates(one(B.GatherElements(1), [(4, 9)], extra=lambda b: [b.input("i", (4, 6), "int64", -9, 9)]))


def test_window_pooling():
    check_node_candidates(one(B.Window((3, 3), (2, 1), (1, 2), (1, 1), (1, 0), -np.inf), [(2, 3, 9, 8)]))
    check_node_candidates(one(B.Window((2, 2), (2, 2), (1, 1), (0, 0), (0, 0), 0.0), [(1, 2, 8, 8)]))


def test_reshape():
    check_node_candidates(one(B.Reshape((6, 72)), [(2, 3, 9, 8)]))


@pytest.mark.parametrize("a,b,trans_b", [((1, 100), (100, 70), False), ((2, 3, 1, 16), (2, 3, 40, 16), True),
                                         ((2, 3, 2, 40), (2, 3, 40, 16), False), ((100,), (100,), False),
                                         ((3, 1, 64), (64, 33), False), ((1, 64), (48, 64), True)])
def test_matmul_gemv(a, b, trans_b):
    n = 1 if len(b) == 1 else (b[-2] if trans_b else b[-1])
    # a dot over fewer elements than a warp's lanes is offered only where cols cannot run
    expect = ["matmul.dot"] if a[-1] >= 32 or n == 1 else ["matmul.cols"]
    cands = check_node_candidates(one(B.MatMul(False, trans_b), [a, b]), expect_templates=expect)
    if b[-1] > 1 and len(b) > 1:
        assert "matmul.cols" in {c.name for c in cands}
    if a[-1] < 32 and n > 1:
        assert "matmul.dot" not in {c.name for c in cands}


@pytest.mark.parametrize("t", [2200, 2201])   # 2201: the last unit's rows run past the outputs
def test_matmul_dot_rows_for_short_reductions(t):
    """q.K^T of decode attention (K = 64 = lanes x 2): units of several outputs are offered."""
    cands = check_node_candidates(one(B.MatMul(False, True), [(1, 12, 1, 64), (1, 12, t, 64)]))
    assert {c.params.rows for c in cands if c.name == "matmul.dot"} >= {1, 4, 8}


def test_matmul_trans_a():
    check_node_candidates(one(B.MatMul(True, False), [(40, 1), (40, 24)]))


@pytest.mark.parametrize("stride,pad,mult,k", [((1, 2), ((1, 1), (1, 0)), 1, 3), ((1, 1), ((1, 1), (1, 1)), 2, 3),
                                               ((1, 1), ((3, 3), (3, 3)), 1, 7)])
def test_depthwise_conv(stride, pad, mult, k):
    C = 4
    b = GraphBuilder("c")
    x = b.input("x", (2, C, 9, 8))
    w = b.input("w", (C * mult, 1, k, k))
    bias = b.input("bias", (C * mult,))
    b.op(B.Conv(stride, pad[0], pad[1], (1, 1), C), [x, w, bias])
    # windows under two warps (3x3: 9, 7x7: 49 taps) get no one-output-per-warp dot; every
    # 2-D depthwise conv gets the SHARED-tile stencil
    cands = check_node_candidates(b.build(), expect_templates=["conv.depthwise.cols", "conv.depthwise.stencil"])
    assert "conv.depthwise.dot" not in {c.name for c in cands}


def test_dense_conv_is_rejected_with_node_name():
    b = GraphBuilder("c")
    x, w = b.input("x", (1, 4, 6, 6)), b.input("w", (8, 4, 3, 3))
    b.op(B.Conv((1, 1), (0, 0), (0, 0), (1, 1), 1), [x, w])
    with pytest.raises(NodeError, match="depthwise"):
        check_node_candidates(b.build())


@pytest.mark.parametrize("target", ["hip", "mlu", "cpu"])
def test_other_targets(target):
    """64-lane wavefronts, single-lane units and group size 1 give correct graphs too."""
    for case in (one(B.Reduce("sum", (1,), True), [(5, 150)]), one(B.Transpose((1, 0)), [(70, 33)]),
                 one(B.Elementwise("add"), [(3, 100), (3, 100)])):
        check_node_candidates(case, target)



def test_a_per_channel_broadcast_takes_the_chunk_maps_vector():
    """A (C, 1, 1) parameter broadcast over N x C x H x W under a chunk tiling of vec 4 (W a
    multiple of 4): each lane's 4 elements share one channel, so the load is one address per
    lane's vector (its first element's) and the candidate exists; the numbers match numpy. With
    W = 6 a lane's vector would span two rows: no vec-4 chunk candidate."""
    from powerfusion import basic as B
    from powerfusion.gir.interpreter import run_gir
    from powerfusion.templates import buffer_names, candidates
    for w, offered in ((8, True), (6, False)):
        b = GraphBuilder("bc", 0)
        p = b.input("p", (3, 1, 1), "float32")
        b.op(B.Broadcast((2, 3, 4, w)), [p])
        g = b.build()
        node = g.graph.nodes[-1]
        names = buffer_names(list(g.graph.tensors))
        cands = [c for c in candidates(node, g.graph.tensors, "cuda", names)
                 if c.name == "broadcast.chunk" and c.params.vec == 4]
        assert bool(cands) == offered
        for c in cands:
            got = run_gir(c.build(), {names["p"]: b.values["p"]})[names[node.outputs[0]]]
            np.testing.assert_array_equal(got.reshape(2, 3, 4, w), np.broadcast_to(b.values["p"], (2, 3, 4, w)))
