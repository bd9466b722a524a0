"""The greedy driver: the Relu-then-Add worked example, the trace, the memo and the invariants."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.gir.expr import J, U
from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.ir import Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel, Scope, Sync
from powerfusion.gir.traffic import kernel_count, traffic
from powerfusion.rewrite import driver, optimise
from powerfusion.rewrite.base import Rewrite

N, W = 1000, 128          # 1000 elements, units of 128 (32 lanes x 4 per lane), tail masked
UNITS = -(-N // W)


def _g(name):
    return MemorySlice.strided(name, Level.GLOBAL, U * W, 1, W, W, "float32", vec=4, valid=(U * W + J).lt(N))


def _r(name):
    return MemorySlice.strided(name, Level.REGISTER, 0, 1, W, W, "float32", vec=4)


def relu_then_add() -> GIRGraph:
    """Two templates merged on T with a DEVICE sync, as the merge step emits them."""
    ops = [GOp(Move(), (_g("X"),), (_r("x"),)), GOp(Elementwise("relu"), (_r("x"),), (_r("t"),)),
           GOp(Move(), (_r("t"),), (_g("T"),)), GOp(Sync(Scope.DEVICE), (_g("T"),), (_g("T"),)),
           GOp(Move(), (_g("T"),), (_r("t2"),)), GOp(Move(), (_g("Y"),), (_r("y"),)),
           GOp(Elementwise("add"), (_r("t2"), _r("y")), (_r("z"),)), GOp(Move(), (_r("z"),), (_g("Z"),))]
    bufs = [Buffer(n, Level.GLOBAL, N, "float32") for n in "XYTZ"]
    bufs += [Buffer(n, Level.REGISTER, W, "float32") for n in ("x", "t", "t2", "y", "z")]
    return GIRGraph("relu_add", Parallel(UNITS, 4, 32), tuple(bufs), tuple(ops), ("X", "Y"), ("Z",))


def _global_accesses(g: GIRGraph, name: str, side: str) -> int:
    return sum(1 for op in g.ops if not isinstance(op.args, Sync)
               for s in getattr(op, side) if s.buffer == name)


def test_relu_then_add_is_one_kernel_with_one_read_of_x_and_one_write():
    before = relu_then_add()
    after, trace = optimise(before)
    assert kernel_count(before) == 2 and kernel_count(after) == 1
    assert _global_accesses(after, "X", "inputs") == 1 and _global_accesses(after, "Y", "inputs") == 1
    assert _global_accesses(after, "Z", "outputs") == 1
    assert all(b.level != Level.GLOBAL for b in after.buffers if b.name not in ("X", "Y", "Z"))
    assert traffic(after)["global"] == 3 * N * 4          # read X, read Y, write Z: nothing else
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    np.testing.assert_array_equal(run_gir(after, {"X": x, "Y": y})["Z"], np.maximum(x, 0) + y)
    assert trace and trace[-1].after.ops == after.ops
    for step in trace:
        assert step.changed and all(isinstance(u, int) for u in step.changed)


def test_memo_optimises_a_repeated_subgraph_once():
    driver.clear_memo()
    a, ta = optimise(relu_then_add())
    calls = []
    real = driver._exhaust
    driver._exhaust = lambda *args: calls.append(1) or real(*args)
    try:
        b, tb = optimise(relu_then_add().__class__(**{**relu_then_add().__dict__, "name": "layer2"}))
    finally:
        driver._exhaust = real
    assert not calls and b.name == "layer2" and b.ops == a.ops and len(tb) == len(ta)


def test_a_rule_that_does_not_make_progress_is_caught(monkeypatch):
    def spin(g, at):      # rewrites to the same schedule: the measure does not drop
        return Rewrite(g.ops, g.buffers, ()) if at == 0 else None
    monkeypatch.setattr(driver, "PHASES", (("spin", {"spin": spin}), ("merge", {})))
    driver.clear_memo()
    with pytest.raises(driver.RewriteInvariantError, match="measure"):
        driver.optimise(relu_then_add())


def test_a_rule_that_raises_traffic_is_caught(monkeypatch):
    def copy_x(g, at):    # an extra global copy of X: more traffic
        if at or any(b.name == "X2" for b in g.buffers):
            return None
        extra = GOp(Move(), (_g("X"),), (_g("X2"),))
        return Rewrite((extra,) + g.ops, g.buffers + (Buffer("X2", Level.GLOBAL, N, "float32"),), ())
    monkeypatch.setattr(driver, "PHASES", (("bad", {"bad": copy_x}), ("merge", {})))
    g = relu_then_add()
    driver.clear_memo()
    with pytest.raises(driver.RewriteInvariantError, match="traffic"):
        driver.optimise(GIRGraph(g.name, g.parallel, g.buffers, g.ops, g.inputs, g.outputs + ("X2",)))
