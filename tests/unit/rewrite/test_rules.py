"""One before / expected pair (and a must-not-fire case) for every rewrite rule.

Tensors are 4 x 4 float32; with the "rows" tiling unit u (of 4, two per group, 4 lanes)
handles row u: global index u*4 + j, registers in identity layout.
"""
from __future__ import annotations

from powerfusion.gir.expr import I, J, U, binop
from powerfusion.gir.ir import Elementwise, GOp, Level, Move, Reduce, Scope, Sync
from powerfusion.rewrite import MERGE_RULES, SWAP_RULES, SYNC_RULES
from powerfusion.rewrite.merge_split import compose_split
from powerfusion.rewrite.merge_rules import (cancel_moves, compose_moves, drop_dead_op, drop_identity_move,
                                             merge_parallel_moves)
from powerfusion.rewrite.swap_rules import swap_ew_move, swap_ew_reduce, swap_ew_through_memory
from powerfusion.rewrite.sync_rules import drop_unread_sync, forward_output, promote_sync
from tests.rewrite.util import gbuf, glob, graph, reg, check_rule

C = 4
N = 16


def row(name, index=None):
    return glob(name, U * C + J if index is None else index, 1, C)


def col(name):
    return glob(name, I * C + U, C, 1)


def rbuf(name, size=C, level=Level.REGISTER):
    return gbuf(name, size, level)


def mv(src, dst, guard=None):
    return GOp(Move(), (src,), (dst,), guard)


def ew(fn, ins, out):
    return GOp(Elementwise(fn), tuple(ins), (out,))


def sync(scope, ins, outs):
    return GOp(Sync(scope), tuple(ins), tuple(outs))


def test_every_rule_has_a_test_here():
    tested = {promote_sync, drop_unread_sync, forward_output, cancel_moves, compose_moves, compose_split, drop_identity_move,
              merge_parallel_moves, drop_dead_op, swap_ew_move, swap_ew_through_memory, swap_ew_reduce}
    assert set(SYNC_RULES.values()) | set(MERGE_RULES.values()) | set(SWAP_RULES.values()) == tested


# ---- sync rules ---------------------------------------------------------------------

def _store_sync_load(read_slice, writer=None):
    ops = [mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), writer or row("T")),
           sync(Scope.DEVICE, [writer or row("T")], [read_slice]), mv(read_slice, reg("y", 1, C)),
           mv(reg("y", 1, C), row("Z"))]
    bufs = [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("x"), rbuf("y")]
    return graph(ops, bufs, ["X"], ["Z"])


def test_promote_lane_keeps_data_in_registers_and_drops_the_sync():
    before = _store_sync_load(row("T"))
    t = reg("T_lane", 1, C)
    expected = graph([mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), t), mv(t, reg("y", 1, C)),
                      mv(reg("y", 1, C), row("Z"))],
                     [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("T_lane")], ["X"], ["Z"])
    check_rule(promote_sync, before, 2, expected)


def test_promote_warp_stages_through_a_per_warp_shared_region():
    rev = row("T", U * C + (C - 1) - J)          # same unit, other lane
    before = _store_sync_load(rev)
    w = glob("T_warp", (U % 2) * C + J, 1, C).at(Level.SHARED)
    r = glob("T_warp", (U % 2) * C + (C - 1) - J, 1, C).at(Level.SHARED)
    expected = graph([mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), w), sync(Scope.WARP, [w], [r]),
                      mv(r, reg("y", 1, C)), mv(reg("y", 1, C), row("Z"))],
                     [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("T_warp", 2 * C, Level.SHARED)],
                     ["X"], ["Z"])
    check_rule(promote_sync, before, 2, expected)


def test_promote_block_stages_through_shared_memory():
    partner = row("T", ((U // 2) * 2 + 1 - U % 2) * C + J)   # the other unit of the group
    before = _store_sync_load(partner)
    w = glob("T_block", (U % 2) * C + J, 1, C).at(Level.SHARED)
    r = glob("T_block", (1 - U % 2) * C + J, 1, C).at(Level.SHARED)
    expected = graph([mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), w), sync(Scope.BLOCK, [w], [r]),
                      mv(r, reg("y", 1, C)), mv(reg("y", 1, C), row("Z"))],
                     [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("T_block", 2 * C, Level.SHARED)],
                     ["X"], ["Z"])
    check_rule(promote_sync, before, 2, expected)


def test_promote_does_not_fire_across_groups_or_on_outputs():
    across = row("T", ((U + 2) % 4) * C + J)                  # a unit of the other group
    check_rule(promote_sync, _store_sync_load(across), 2, None)
    g = _store_sync_load(row("T"))
    check_rule(promote_sync, graph(g.ops, g.buffers, ["X"], ["Z", "T"]), 2, None)


def test_forward_output_reads_the_writers_registers_and_keeps_the_store():
    g = _store_sync_load(row("T"))
    before = graph(g.ops, g.buffers, ["X"], ["Z", "T"])        # T is an output and read back
    t = reg("T_fwd_lane", 1, C)
    expected = graph([mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), row("T")), mv(reg("x", 1, C), t),
                      mv(t, reg("y", 1, C)), mv(reg("y", 1, C), row("Z"))],
                     [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("T_fwd_lane")],
                     ["X"], ["Z", "T"])
    check_rule(forward_output, before, 2, expected)


def test_forward_output_does_not_fire_on_intermediates_or_across_groups():
    check_rule(forward_output, _store_sync_load(row("T")), 2, None)     # promote_sync's case
    g = _store_sync_load(row("T", ((U + 2) % 4) * C + J))             # a unit of the other group
    check_rule(forward_output, graph(g.ops, g.buffers, ["X"], ["Z", "T"]), 2, None)


def test_drop_unread_sync():
    ops = [mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), row("T")), sync(Scope.DEVICE, [row("T")], [row("T")]),
           mv(row("X"), row("Z"))]
    bufs = [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("x")]
    before = graph(ops, bufs, ["X"], ["Z", "T"])
    expected = graph(ops[:2] + ops[3:], bufs, ["X"], ["Z", "T"])
    check_rule(drop_unread_sync, before, 2, expected)
    check_rule(drop_unread_sync, _store_sync_load(row("T")), 2, None)


# ---- merge rules --------------------------------------------------------------------

def test_cancel_moves_store_then_load_of_the_same_pattern():
    ops = [mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), reg("t", 1, C)), mv(reg("t", 1, C), reg("y", 1, C)),
           ew("relu", [reg("y", 1, C)], reg("z", 1, C)), mv(reg("z", 1, C), row("Z"))]
    bufs = [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("t"), rbuf("y"), rbuf("z")]
    before = graph(ops, bufs, ["X"], ["Z"])
    expected = graph([ops[0], ew("relu", [reg("x", 1, C)], reg("z", 1, C)), ops[4]],
                     [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("z")], ["X"], ["Z"])
    check_rule(cancel_moves, before, 2, expected)
    check_rule(cancel_moves, graph(ops, bufs, ["X"], ["Z", "y"]), 2, None)   # y is an output


def test_compose_moves_through_an_intermediate_nothing_else_reads():
    # a global->global relayout (row-major copy) then a column-wise load: one load of X
    ops = [mv(row("X"), row("T")), sync(Scope.DEVICE, [row("T")], [col("T")]), mv(col("T"), reg("y", C, 1)),
           mv(reg("y", C, 1), col("Z"))]
    bufs = [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("y")]
    before = graph(ops, bufs, ["X"], ["Z"])
    expected = graph([mv(col("X"), reg("y", C, 1)), ops[3]], [gbuf("X", N), gbuf("Z", N), rbuf("y")], ["X"], ["Z"])
    check_rule(compose_moves, before, 2, expected)   # T and its sync go in the same step
    # T is an output: the first move stays, the reader is split off onto X
    keep = graph(ops, bufs, ["X"], ["Z", "T"])
    check_rule(compose_moves, keep, 2, graph([ops[0], ops[1], mv(col("X"), reg("y", C, 1)), ops[3]], bufs,
                                              ["X"], ["Z", "T"]))


def test_compose_moves_through_rows_with_a_partial_last_segment():
    # rows of 6 in segments of 4 (num 2, the second half masked), as a channel shuffle's 784-element
    # planes in segments of 128: unit u reads the row unit 3 - u wrote. The writer's i and j are
    # one flat digit (i * 4 + j < 6), so the reader reads X's row 3 - u directly.
    def rows6(name, first):
        return glob(name, first * 6 + I * 4 + J, 2, 4, valid=(I * 4 + J).lt(6))
    ops = [mv(rows6("X", U), rows6("T", U)), sync(Scope.DEVICE, [rows6("T", U)], [rows6("T", 3 - U)]),
           mv(rows6("T", 3 - U), reg("y", 2, 4)), mv(reg("y", 2, 4), rows6("Z", U))]
    bufs = [gbuf("X", 24), gbuf("T", 24), gbuf("Z", 24), gbuf("y", 8, Level.REGISTER)]
    before = graph(ops, bufs, ["X"], ["Z"])
    expected = graph([mv(rows6("X", 3 - U), reg("y", 2, 4)), ops[3]],
                     [gbuf("X", 24), gbuf("Z", 24), gbuf("y", 8, Level.REGISTER)], ["X"], ["Z"])
    check_rule(compose_moves, before, 2, expected)


def test_compose_moves_refuses_a_register_source_read_by_another_unit():
    ops = [mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), row("T")), sync(Scope.DEVICE, [row("T")], [col("T")]),
           mv(col("T"), reg("y", C, 1)), mv(reg("y", C, 1), col("Z"))]
    bufs = [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("x"), rbuf("y")]
    check_rule(compose_moves, graph(ops, bufs, ["X"], ["Z"]), 3, None)


def test_compose_split_through_a_concat_read_column_wise():
    # T = concat(X, Y) along rows (units 0-1 copy X, units 2-3 copy Y), then read by columns
    wa = GOp(Move(), (row("X"),), (row("T"),), U.lt(2))
    wb = GOp(Move(), (glob("X2", (U - 2) * C + J, 1, C),), (row("T"),), binop("le", 2, U))
    ops = [wa, wb, sync(Scope.DEVICE, [row("T"), row("T")], [col("T")]), mv(col("T"), reg("y", C, 1)),
           mv(reg("y", C, 1), col("Z"))]
    bufs = [gbuf("X", 8), gbuf("X2", 8), gbuf("T", N), gbuf("Z", N), rbuf("y")]
    before = graph(ops, bufs, ["X", "X2"], ["Z"])
    top, bottom = I.lt(2), binop("le", 2, I)
    expected = graph([mv(glob("X", I * C + U, C, 1, valid=top), reg("y", C, 1, valid=top)),
                      mv(glob("X2", (I - 2) * C + U, C, 1, valid=bottom), reg("y", C, 1, valid=bottom)), ops[4]],
                     [gbuf("X", 8), gbuf("X2", 8), gbuf("Z", N), rbuf("y")], ["X", "X2"], ["Z"])
    check_rule(compose_split, before, 3, expected)
    # a second reader of T (an output of its own) would need four moves for three: no
    extra = [*ops, mv(col("T"), reg("w", C, 1)), mv(reg("w", C, 1), col("Z2")),
             mv(row("T"), reg("v", 1, C)), mv(reg("v", 1, C), row("Z3"))]
    many = graph(extra, bufs + [rbuf("w"), rbuf("v"), gbuf("Z2", N), gbuf("Z3", N)], ["X", "X2"], ["Z", "Z2", "Z3"])
    check_rule(compose_split, many, 3, None)


def test_drop_identity_move():
    ops = [mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), reg("y", 1, C)), mv(reg("y", 1, C), row("Z"))]
    bufs = [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("y")]
    expected = graph([ops[0], mv(reg("x", 1, C), row("Z"))], [gbuf("X", N), gbuf("Z", N), rbuf("x")], ["X"], ["Z"])
    check_rule(drop_identity_move, graph(ops, bufs, ["X"], ["Z"]), 1, expected)
    masked = mv(reg("x", 1, C), reg("y", 1, C, valid=J.lt(2)))
    check_rule(drop_identity_move, graph([ops[0], masked, ops[2]], bufs, ["X"], ["Z"]), 1, None)


def test_merge_parallel_moves_reading_the_same_slice():
    ops = [mv(row("X"), reg("x", 1, C)), mv(row("X"), reg("y", 1, C)),
           ew("mul", [reg("x", 1, C), reg("y", 1, C)], reg("z", 1, C)), mv(reg("z", 1, C), row("Z"))]
    bufs = [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("z")]
    expected = graph([ops[0], ew("mul", [reg("x", 1, C), reg("x", 1, C)], reg("z", 1, C)), ops[3]],
                     [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("z")], ["X"], ["Z"])
    check_rule(merge_parallel_moves, graph(ops, bufs, ["X"], ["Z"]), 1, expected)
    # the second copy goes to global memory: it reads the registers instead of X
    ops2 = [ops[0], mv(row("X"), row("W")), ew("relu", [reg("x", 1, C)], reg("z", 1, C)), ops[3]]
    bufs2 = [gbuf("X", N), gbuf("W", N), gbuf("Z", N), rbuf("x"), rbuf("z")]
    expected2 = graph([ops[0], mv(reg("x", 1, C), row("W")), ops2[2], ops[3]], bufs2, ["X"], ["Z", "W"])
    check_rule(merge_parallel_moves, graph(ops2, bufs2, ["X"], ["Z", "W"]), 1, expected2)


def test_drop_dead_op_removes_an_unread_intermediate_with_its_store():
    ops = [mv(row("X"), reg("x", 1, C)), mv(reg("x", 1, C), row("T")), mv(reg("x", 1, C), row("Z"))]
    bufs = [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("x")]
    expected = graph([ops[0], ops[2]], [gbuf("X", N), gbuf("Z", N), rbuf("x")], ["X"], ["Z"])
    check_rule(drop_dead_op, graph(ops, bufs, ["X"], ["Z"]), 1, expected)
    check_rule(drop_dead_op, graph(ops, bufs, ["X"], ["Z", "T"]), 1, None)


# ---- swap rules ---------------------------------------------------------------------

def test_swap_elementwise_forward_past_a_register_move():
    ops = [mv(row("X"), reg("x", 1, C)), ew("exp", [reg("x", 1, C)], reg("y", 1, C)),
           mv(reg("y", 1, C), reg("z", 1, C)), mv(reg("z", 1, C), row("Z"))]
    bufs = [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("z")]
    expected = graph([ops[0], mv(reg("x", 1, C), reg("z_pre", 1, C)), ew("exp", [reg("z_pre", 1, C)], reg("z", 1, C)),
                      ops[3]], [gbuf("X", N), gbuf("Z", N), rbuf("x"), rbuf("z_pre"), rbuf("z")], ["X"], ["Z"])
    check_rule(swap_ew_move, graph(ops, bufs, ["X"], ["Z"]), 1, expected)


def test_swap_elementwise_forward_through_memory_and_sync():
    ops = [mv(row("X"), reg("x", 1, C)), ew("tanh", [reg("x", 1, C)], reg("y", 1, C)), mv(reg("y", 1, C), row("T")),
           sync(Scope.DEVICE, [row("T")], [col("T")]), mv(col("T"), reg("z", C, 1)), mv(reg("z", C, 1), col("Z"))]
    bufs = [gbuf("X", N), gbuf("T", N), gbuf("Z", N), rbuf("x"), rbuf("y"), rbuf("z")]
    expected = graph([ops[0], mv(reg("x", 1, C), row("T_pre")), sync(Scope.DEVICE, [row("T_pre")], [col("T_pre")]),
                      mv(col("T_pre"), reg("z_pre", C, 1)), ew("tanh", [reg("z_pre", C, 1)], reg("z", C, 1)), ops[5]],
                     [gbuf("X", N), gbuf("T_pre", N), gbuf("Z", N), rbuf("x"), rbuf("z"), rbuf("z_pre")], ["X"], ["Z"])
    check_rule(swap_ew_through_memory, graph(ops, bufs, ["X"], ["Z"]), 1, expected)
    ops[1] = ew("add", [reg("x", 1, C), reg("x", 1, C)], reg("y", 1, C))     # not unary: stays
    check_rule(swap_ew_through_memory, graph(ops, bufs, ["X"], ["Z"]), 1, None)


def test_swap_monotone_elementwise_past_max_reduce():
    one = reg("r", 1, 1)
    ops = [mv(row("X"), reg("x", 1, C)), ew("exp", [reg("x", 1, C)], reg("y", 1, C)),
           GOp(Reduce("max", "width"), (reg("y", 1, C),), (one,)), mv(one, glob("Z", U, 1, 1))]
    bufs = [gbuf("X", N), gbuf("Z", 4), rbuf("x"), rbuf("y"), rbuf("r", 1)]
    pre = reg("r_pre", 1, 1)
    expected = graph([ops[0], GOp(Reduce("max", "width"), (reg("x", 1, C),), (pre,)), ew("exp", [pre], one), ops[3]],
                     [gbuf("X", N), gbuf("Z", 4), rbuf("x"), rbuf("r", 1), rbuf("r_pre", 1)], ["X"], ["Z"])
    check_rule(swap_ew_reduce, graph(ops, bufs, ["X"], ["Z"]), 1, expected)
    ops[1] = ew("neg", [reg("x", 1, C)], reg("y", 1, C))                    # decreasing: max would become min
    check_rule(swap_ew_reduce, graph(ops, bufs, ["X"], ["Z"]), 1, None)
    ops[1] = ew("exp", [reg("x", 1, C)], reg("y", 1, C))
    ops[2] = GOp(Reduce("sum", "width"), (reg("y", 1, C),), (one,))        # sum(exp) != exp(sum)
    check_rule(swap_ew_reduce, graph(ops, bufs, ["X"], ["Z"]), 1, None)





def test_a_remembered_failed_promotion_is_not_reused_where_the_graph_differs():
    # T refused as an output of the graph (the model sees it); the same window where T is not an
    # output must still be promoted, and the refused case stays refused when asked again
    seen = _store_sync_load(row("T"))
    refused = graph(list(seen.ops), list(seen.buffers), ["X"], ["Z", "T"])
    assert promote_sync(refused, 2) is None
    assert promote_sync(refused, 2) is None
    assert promote_sync(seen, 2) is not None
    # a reader far outside the window (before the writer) is part of what is remembered too
    early = graph([mv(row("T"), reg("w", 1, C)), mv(reg("w", 1, C), row("W"))] + list(seen.ops),
                  list(seen.buffers) + [rbuf("w"), gbuf("W", N)], ["X"], ["Z", "W"])
    assert promote_sync(early, 4) is None
    assert promote_sync(seen, 2) is not None
