"""The verifier rejects each kind of broken graph (before / broken / message), accepts the
templates, and needed_scope decides LANE / WARP / BLOCK / DEVICE exactly."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from powerfusion import basic as B
from powerfusion.gir.expr import I, J, Load, U
from powerfusion.gir.ir import (Broadcast, Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel,
                                Reduce, Scope, Sync)
from powerfusion.gir.scope import needed_scope
from powerfusion.gir.verifier import GIRVerifyError, verify
from powerfusion.templates import buffer_names, candidates
from tests.templates.strategies import GraphBuilder


def reduce_candidates(shape=(3, 5, 70)):
    b = GraphBuilder("r")
    b.op(B.Reduce("sum", (len(shape) - 1,), True), [b.input("x", shape)])
    case = b.build()
    g = case.graph
    return {c.name: c.build() for c in candidates(g.nodes[0], g.tensors, "cuda", buffer_names(list(g.tensors)))}


def relu_add(n=1000, W=128, sync=Scope.DEVICE, shift=0):
    """The docs/design.md example: relu then add through T in global memory; `shift` makes each unit
    read the neighbour's chunk of T."""
    units = -(-n // W)
    P = Parallel(units, 4, 32)

    def g(b, off=U * W):
        return MemorySlice.strided(b, Level.GLOBAL, off, 1, W, W, "float32", vec=4, valid=(off + J).lt(n))

    def r(b):
        return MemorySlice.strided(b, Level.REGISTER, 0, 1, W, W, "float32", vec=4)
    t_read = g("T", ((U + shift) % units) * W)
    ops = [GOp(Move(), (g("X"),), (r("x"),)), GOp(Elementwise("relu"), (r("x"),), (r("t"),)),
           GOp(Move(), (r("t"),), (g("T"),)), GOp(Sync(sync), (g("T"),), (t_read,)),
           GOp(Move(), (t_read,), (r("t2"),)), GOp(Move(), (g("Y"),), (r("y"),)),
           GOp(Elementwise("add"), (r("t2"), r("y")), (r("z"),)), GOp(Move(), (r("z"),), (g("Z"),))]
    bufs = tuple(Buffer(b, Level.GLOBAL, n, "float32") for b in "XYTZ") + tuple(
        Buffer(b, Level.REGISTER, W, "float32") for b in ("x", "t", "t2", "y", "z"))
    return GIRGraph("relu_add", P, bufs, tuple(ops), ("X", "Y"), ("Z",))


def broken(g: GIRGraph, k: int, **changes) -> GIRGraph:
    ops = list(g.ops)
    ops[k] = replace(ops[k], **changes)
    return g.with_ops(ops)


def test_accepts_example_and_templates():
    verify(relu_add())
    verify(relu_add(sync=Scope.LANE))   # every element read by its writer: no sync needed
    for g in reduce_candidates().values():
        verify(g)


def test_cross_unit_read_needs_device_sync():
    verify(relu_add(shift=1))  # DEVICE sync in place
    with pytest.raises(GIRVerifyError, match="device sync"):
        verify(relu_add(shift=4, sync=Scope.BLOCK))  # neighbour in another group
    with pytest.raises(GIRVerifyError, match="block sync"):
        verify(relu_add(shift=1, sync=Scope.WARP))   # neighbour in the same group


@pytest.mark.parametrize("name,scope", [("reduce.block", Scope.BLOCK), ("reduce.grid", Scope.DEVICE)])
def test_missing_or_weak_sync(name, scope):
    g = reduce_candidates()[name]
    k = next(i for i, o in enumerate(g.ops) if isinstance(o.args, Sync))
    with pytest.raises(GIRVerifyError, match="sync between"):
        verify(g.with_ops(g.ops[:k] + g.ops[k + 1:]))
    with pytest.raises(GIRVerifyError, match="sync between"):
        verify(broken(g, k, args=Sync(Scope(scope - 1))))


def test_out_of_bounds_slice():
    g = reduce_candidates()["reduce.row_warp"]
    s = g.ops[0].inputs[0]
    with pytest.raises(GIRVerifyError, match="outside 'x'"):
        verify(broken(g, 0, inputs=(replace(s, valid=None),)))


def test_read_before_write():
    g = reduce_candidates()["reduce.row_warp"]
    with pytest.raises(GIRVerifyError, match="before anything writes it"):
        verify(g.with_ops(g.ops[1:]))


def test_shapes_and_levels():
    g = relu_add()
    with pytest.raises(GIRVerifyError, match="element count"):
        verify(broken(g, 0, outputs=(MemorySlice.strided("x", Level.REGISTER, 0, 1, 64, 64, "float32"),)))
    with pytest.raises(GIRVerifyError, match="registers"):
        verify(broken(g, 1, inputs=(g.ops[0].inputs[0],)))
    with pytest.raises(GIRVerifyError, match="operand"):
        other = MemorySlice.strided("y", Level.REGISTER, 0, 2, 64, 64, "float32")
        verify(broken(g, 6, inputs=(g.ops[6].inputs[0], other)))
    r = MemorySlice.strided("x", Level.REGISTER, 0, 1, 128, 128, "float32")
    with pytest.raises(GIRVerifyError, match="reduce over width"):
        verify(broken(g, 1, args=Reduce("sum", "width"), outputs=(r,)))
    with pytest.raises(GIRVerifyError, match="broadcast over width"):
        verify(broken(g, 1, args=Broadcast("width"), outputs=(r,)))
    with pytest.raises(GIRVerifyError, match="typed"):
        verify(broken(g, 0, inputs=(replace(g.ops[0].inputs[0], dtype="float16"),)))
    with pytest.raises(GIRVerifyError, match="cannot be guarded"):
        verify(broken(g, 3, guard=U.lt(3)))


def test_register_data_crossing_lanes_needs_warp_sync():
    g = reduce_candidates()["reduce.row_warp"]
    r = g.ops[0].outputs[0]
    shifted = MemorySlice(r.buffer, Level.REGISTER, I * r.width + (J + 1) % r.width, r.num, r.width, r.dtype, r.vec)
    tmp = MemorySlice.strided("tmp", Level.REGISTER, 0, r.num, r.width, r.width, r.dtype, r.vec)
    bufs = g.buffers + (Buffer("tmp", Level.REGISTER, r.count, r.dtype),)
    ops = list(g.ops)
    ops.insert(1, GOp(Move(), (shifted,), (tmp,)))
    with pytest.raises(GIRVerifyError, match="warp sync"):
        verify(g.with_ops(ops, bufs))
    ops.insert(1, GOp(Sync(Scope.WARP), (r,), (shifted,)))
    verify(g.with_ops(ops, bufs))


def test_output_must_be_fully_written():
    g = relu_add()
    z = g.ops[-1].outputs[0]
    with pytest.raises(GIRVerifyError, match="never written"):
        verify(broken(g, len(g.ops) - 1, outputs=(replace(z, valid=(U * 128 + J).lt(900)),)))


def test_gather_index_must_be_bounded():
    n = 64
    idx = Load("I", U * 32 + J)
    data = MemorySlice("D", Level.GLOBAL, idx, 1, 32, "float32")
    ops = (GOp(Move(), (data,), (MemorySlice.strided("r", Level.REGISTER, 0, 1, 32, 32, "float32"),)),
           GOp(Move(), (MemorySlice.strided("r", Level.REGISTER, 0, 1, 32, 32, "float32"),),
               (MemorySlice.strided("Y", Level.GLOBAL, U * 32, 1, 32, 32, "float32"),)))
    bufs = (Buffer("D", Level.GLOBAL, n, "float32"), Buffer("I", Level.GLOBAL, n, "int64"),
            Buffer("Y", Level.GLOBAL, n, "float32"), Buffer("r", Level.REGISTER, 32, "float32"))
    g = GIRGraph("gather", Parallel(2, 1, 32), bufs, ops, ("D", "I"), ("Y",))
    with pytest.raises(GIRVerifyError, match="bound the loaded index"):
        verify(g)
    from powerfusion.templates.common import wrap_clamp
    ok = replace(data, index=wrap_clamp(idx, n))
    verify(g.with_ops((replace(ops[0], inputs=(ok,)), ops[1])))


def test_sampling_large_graphs_still_checks_groups():
    g = reduce_candidates((64, 300))["reduce.block"]
    verify(g, cap=2000)  # sampled: a few whole groups
    k = next(i for i, o in enumerate(g.ops) if isinstance(o.args, Sync))
    with pytest.raises(GIRVerifyError, match="block sync"):
        verify(g.with_ops(g.ops[:k] + g.ops[k + 1:]), cap=2000)


# ---- needed_scope -------------------------------------------------------------------------

P = Parallel(8, 4, 32)
UNITS = np.arange(8)


def chunk(buf="T", level=Level.GLOBAL, off=U * 128, vec=4):
    return MemorySlice.strided(buf, level, off, 1, 128, 128, "float32", vec=vec, valid=(off + J).lt(1000))


@pytest.mark.parametrize("read,want", [
    (chunk(), Scope.LANE),
    (chunk(vec=1), Scope.WARP),                               # same unit, elements on other lanes
    (chunk(off=(U // 4 * 4 + (U + 1) % 4) * 128), Scope.BLOCK),  # neighbour in the group
    (chunk(off=((U + 1) % 8) * 128), Scope.DEVICE),            # across groups
])
def test_needed_scope_global(read, want):
    assert needed_scope(chunk(), UNITS, read, UNITS, P) == want


def test_needed_scope_shared_and_register():
    w = MemorySlice.strided("S", Level.SHARED, U % 4, 1, 1, 1, "float32")
    r = MemorySlice.strided("S", Level.SHARED, 0, 1, 32, 1, "float32", valid=J.lt(4))
    assert needed_scope(w, UNITS, r, UNITS, P) == Scope.BLOCK
    assert needed_scope(w, UNITS, w, UNITS, P) == Scope.LANE
    reg = chunk("x", Level.REGISTER, 0)
    assert needed_scope(reg, UNITS, chunk("x", Level.REGISTER, 0, vec=1), UNITS, P) == Scope.WARP
    # only elements actually written count: a disjoint read needs nothing
    assert needed_scope(chunk(), UNITS[:2], chunk(off=U * 128 + 512), UNITS[:2], P) == Scope.LANE


BIG_P = Parallel(4096, 4, 32)
BIG_UNITS = np.arange(4096)


@pytest.mark.parametrize("read", [
    chunk(), chunk(vec=1), chunk(off=(U // 4 * 4 + (U + 1) % 4) * 128), chunk(off=((U + 1) % 4096) * 128),
])
def test_needed_scope_sampled_beyond_cap_agrees_with_exact(read, monkeypatch):
    import powerfusion.gir.scope as scope
    exact = needed_scope(chunk(), BIG_UNITS, read, BIG_UNITS, BIG_P)
    monkeypatch.setattr(scope, "SAMPLE", 4 * 128 * 8)   # a handful of the 1024 groups
    assert scope.sample_groups(BIG_UNITS, 4, 128, scope.SAMPLE).size < 1024
    assert needed_scope(chunk(), BIG_UNITS, read, BIG_UNITS, BIG_P, cap=10) == exact


def test_needed_scope_sampled_is_conservative_for_unwritten_global_reads():
    # exact: the reads touch nothing written here (LANE); sampled: cannot tell who wrote them (DEVICE)
    disjoint = chunk(off=U * 128 + 512)
    assert needed_scope(chunk(), UNITS[:2], disjoint, UNITS[:2], P) == Scope.LANE
    assert needed_scope(chunk(), UNITS[:2], disjoint, UNITS[:2], P, cap=10) == Scope.DEVICE


def test_needed_scope_structural_for_gathers_without_data():
    from powerfusion.gir.expr import Load
    g = MemorySlice.strided("T", Level.GLOBAL, Load("idx", U) * 128, 1, 128, 128, "float32")
    assert needed_scope(g, UNITS, g, UNITS, P) == Scope.LANE
    assert needed_scope(chunk(), UNITS, g, UNITS, P) == Scope.DEVICE


def test_overwrite_after_another_units_read_needs_sync():
    """Write after read: unit u reads its neighbour's chunk of T, then T is rewritten."""
    g = relu_add(shift=1)
    t_write = g.ops[2]
    ops = list(g.ops) + [replace(t_write, inputs=(g.ops[-1].inputs[0],))]
    with pytest.raises(GIRVerifyError, match="overwrites element"):
        verify(g.with_ops(ops))
    verify(g.with_ops(list(g.ops) + [GOp(Sync(Scope.DEVICE), (), ()), ops[-1]]))
