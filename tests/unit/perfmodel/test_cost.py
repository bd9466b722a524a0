"""Cost model: estimates add up, and each modelled effect moves the prediction the right way."""
from __future__ import annotations

import math

import pytest

from powerfusion.gir.expr import I, J, U
from powerfusion.gir.ir import (Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel, Scope,
                                Sync)
from powerfusion.perfmodel.cost import Estimate, estimate, kernel_limits, predict_seconds
from powerfusion.targets.specs import get_target, targets

H100 = get_target("h100")
F32 = "float32"


def copy_graph(rows: int, cols: int, vec: int = 4, upg: int = 4, transposed: bool = False, kernels: int = 1,
               chain: tuple[str, ...] = ()) -> GIRGraph:
    """y = f(x) with one unit per row of `cols` elements (x read transposed when asked)."""
    n = rows * cols
    src_index = (J * rows + U) if transposed else (U * cols + I * cols + J)
    x = MemorySlice("x", Level.GLOBAL, src_index, 1, cols, F32, 1 if transposed else vec)
    r = MemorySlice.strided("r", Level.REGISTER, 0, 1, cols, cols, F32, vec=vec)
    y = MemorySlice.strided("y", Level.GLOBAL, U * cols, 1, cols, cols, F32, vec=vec)
    ops = [GOp(Move(), (x,), (r,))]
    for fn in chain:
        ops.append(GOp(Elementwise(fn), (r,), (r,)))
    bufs = [Buffer("x", Level.GLOBAL, n, F32), Buffer("y", Level.GLOBAL, n, F32),
            Buffer("r", Level.REGISTER, cols, F32)]
    if kernels == 2:
        t = MemorySlice.strided("t", Level.GLOBAL, U * cols, 1, cols, cols, F32, vec=vec)
        r2 = MemorySlice.strided("r2", Level.REGISTER, 0, 1, cols, cols, F32, vec=vec)
        ops += [GOp(Move(), (r,), (t,)), GOp(Sync(Scope.DEVICE), (t,), (t,)), GOp(Move(), (t,), (r2,))]
        bufs += [Buffer("t", Level.GLOBAL, n, F32), Buffer("r2", Level.REGISTER, cols, F32)]
        r = r2
    ops.append(GOp(Move(), (r,), (y,)))
    return GIRGraph("g", Parallel(rows, upg, 32), tuple(bufs), tuple(ops), ("x",), ("y",))


def test_estimates_add_up():
    a = Estimate((("global", 10.0),), 5.0, (("block", 1),), 1, 1e-6, 2e-6, 1e-7, 1e-6, ("x",))
    b = Estimate((("global", 4.0), ("shared", 2.0)), 1.0, (("block", 2), ("warp", 1)), 2, 3e-6, 0.0, 0.0, 0.0, ("y",))
    s = a + b
    assert s.bytes("global") == 14.0 and s.bytes("shared") == 2.0
    assert dict(s.syncs) == {"block": 3, "warp": 1}
    assert s.launches == 3 and s.flops == 6.0
    assert s.memory_s == pytest.approx(4e-6) and s.limits == ("x", "y")
    assert (a + Estimate()) == a


def test_graph_estimate_is_sum_of_kernels():
    g2 = copy_graph(4096, 1024, kernels=2)
    e = estimate(g2, H100)
    assert e.launches == 2
    # x read, t written, t read, y written: each 4096*1024*4 bytes at the global level
    assert e.bytes("global") == pytest.approx(4 * 4096 * 1024 * 4)


def test_large_copy_runs_near_achievable_bandwidth():
    g = copy_graph(16384, 4096)
    e = estimate(g, H100)
    nbytes = 2 * 16384 * 4096 * 4
    assert e.bytes("global") == pytest.approx(nbytes)
    t = predict_seconds(e, H100)
    ideal = nbytes / (H100.bandwidth * H100.memory.achievable)
    assert ideal <= t <= ideal * 1.1 + 3 * H100.launch_s


def test_extra_kernel_costs_traffic_and_a_launch():
    one, two = (predict_seconds(estimate(copy_graph(2048, 1024, kernels=k), H100), H100) for k in (1, 2))
    assert two > one + H100.launch_s * 0.9


def test_uncoalesced_reads_cost_more():
    fast = predict_seconds(estimate(copy_graph(4096, 4096, vec=1), H100), H100)
    slow = predict_seconds(estimate(copy_graph(4096, 4096, vec=1, transposed=True), H100), H100)
    assert slow > 1.5 * fast


def test_too_few_units_cannot_fill_the_device():
    # the same 8 MiB, as 64 long rows (64 warps) vs 8192 short rows
    few = estimate(copy_graph(64, 32768 // 1, vec=4), H100)
    many = estimate(copy_graph(8192, 256, vec=4), H100)
    assert few.bytes("global") == many.bytes("global")
    assert predict_seconds(few, H100) > 2 * predict_seconds(many, H100)
    assert "parallelism" in few.limits


def test_register_pressure_limits_occupancy():
    small = copy_graph(8192, 256)
    big = copy_graph(8192, 256 * 16)
    ls, lb = (kernel_limits(g, g.kernels()[0], H100) for g in (small, big))
    assert lb.regs_per_lane == 16 * ls.regs_per_lane
    assert lb.capacity_units < ls.capacity_units
    assert lb.limited_by == "registers"


def test_shared_memory_over_the_limit_is_infeasible():
    n = 64 * 1024  # 256 KiB of float32 per group
    s = MemorySlice.strided("s", Level.SHARED, 0, 1, n, n, F32)
    x = MemorySlice.strided("x", Level.GLOBAL, 0, 1, n, n, F32)
    g = GIRGraph("g", Parallel(4, 4, 32), (Buffer("x", Level.GLOBAL, n, F32), Buffer("s", Level.SHARED, n, F32)),
                 (GOp(Move(), (x,), (s,)),), ("x",), ())
    e = estimate(g, H100)
    assert "shared memory" in e.infeasible
    assert math.isinf(predict_seconds(e, H100))


def test_arithmetic_heavy_chain_becomes_compute_bound():
    light = estimate(copy_graph(8192, 1024, chain=("add",)), H100)
    heavy = estimate(copy_graph(8192, 1024, chain=("erf",) * 40), H100)
    assert heavy.flops == 40 * 16 * 8192 * 1024
    assert heavy.compute_s > heavy.memory_s
    assert light.compute_s < light.memory_s
    assert predict_seconds(heavy, H100) > predict_seconds(light, H100)


def test_other_targets_estimate_the_same_graph():
    g = copy_graph(4096, 1024)
    for key in ("a100", "h100", "h200", "mi100", "mi250", "mlu370", "cpu"):
        t = targets()[key]
        # the graph was planned for 32 lanes; the model does not care which target renders it
        assert 0 < predict_seconds(estimate(g, t), t) < 1.0
    slow, fast = (predict_seconds(estimate(g, get_target(k)), get_target(k)) for k in ("a100", "h200"))
    assert slow > fast


def test_a_warp_exchange_is_charged_as_exposed_latency():
    """One unit's row staged through shared memory in another lane layout (store, sync(WARP),
    load) costs EXCHANGE_LATENCY memory latencies more than the same data kept in registers:
    measured ~0.3 us an exchange on the H200 in batch-1 LayerNorm kernels
    (benchmarks/results/perfmodel-accuracy-models.md)."""
    from powerfusion.perfmodel.cost import EXCHANGE_LATENCY
    from powerfusion.gir.ir import Sync
    from tests.rewrite.util import gbuf, glob, graph, reg
    C, N = 4, 16
    row = glob("X", U * C + J, 1, C)
    out = glob("Z", U * C + J, 1, C)
    w = glob("T_warp", (U % 2) * C + J, 1, C).at(Level.SHARED)
    r = glob("T_warp", (U % 2) * C + (C - 1) - J, 1, C).at(Level.SHARED)
    ops = [GOp(Move(), (row,), (reg("x", 1, C),)), GOp(Move(), (reg("x", 1, C),), (w,)),
           GOp(Sync(Scope.WARP), (w,), (r,)), GOp(Move(), (r,), (reg("y", 1, C),)),
           GOp(Move(), (reg("y", 1, C),), (out,))]
    bufs = [gbuf("X", N), gbuf("Z", N), gbuf("x", C, Level.REGISTER), gbuf("y", C, Level.REGISTER),
            gbuf("T_warp", 2 * C, Level.SHARED)]
    staged = graph(ops, bufs, ["X"], ["Z"])
    direct = graph([ops[0], GOp(Move(), (reg("x", 1, C),), (out,))], bufs[:3], ["X"], ["Z"])
    t = get_target("h100")
    extra = estimate(staged, t).latency_s - estimate(direct, t).latency_s
    assert extra == pytest.approx(EXCHANGE_LATENCY * t.memory.latency_s, rel=1e-6)
