"""The rules' memo tables answer a question asked again under other buffer names (the same
exchange in another plan of a search) without working it out again, and hand back answers
that carry the asker's names and uids."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.gir import scope
from powerfusion.gir.expr import I, J, U, binop
from powerfusion.gir.ir import GOp, Level, MemorySlice, Move, Parallel, Scope
from powerfusion.rewrite import merge_split, patterns
from powerfusion.rewrite.patterns import Coords
from tests.rewrite.util import glob

P = Parallel(64, 4, 4)
UNITS = np.arange(64, dtype=np.int64)
UNITS.flags.writeable = False


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(module, name, counted)
    return calls


def _transposed(name):
    """A 64 x 16 tile read back column-wise: a unit reads what four others wrote."""
    write = glob(name, U * 16 + J, 1, 16)
    read = glob(name, (J % 4) * 256 + (U % 16) * 16 + (J // 4) * 4 + U // 16, 1, 16)
    return write, read


def test_sync_scope_is_asked_once_whatever_the_buffer_is_called(monkeypatch):
    scope._MEMO.clear()
    calls = _counting(monkeypatch, scope, "_needed_scope")
    answers = [scope.needed_scope(*_transposed(name)[:1], UNITS, _transposed(name)[1], UNITS, P)
               for name in ("T", "T_lane", "T")]
    assert answers == [Scope.DEVICE] * 3 and len(calls) == 1


def test_writer_coordinates_are_asked_once_whatever_the_buffer_is_called(monkeypatch):
    patterns._COORDS.clear()
    calls = _counting(monkeypatch, patterns, "_writer_coords")
    found = [patterns.writer_coords(glob(n, U * 16 + J, 1, 16), UNITS, glob(n, U * 16 + J, 1, 16), UNITS, P, "unit")
             for n in ("A", "B")]
    assert found[0] == found[1] == Coords(U, I, J) and len(calls) == 1


def test_a_refit_found_under_one_name_is_handed_back_under_the_asker_s():
    patterns._COMPACT.clear()
    nested = lambda name: MemorySlice(name, Level.GLOBAL, ((U * 16 + J) // 8) * 8 + (U * 16 + J) % 8 + 0 * I,
                                      1, 16, "float32")
    first, again = patterns.compact(nested("A"), UNITS), patterns.compact(nested("B"), UNITS)
    assert first.buffer == "A" and again.buffer == "B"
    patterns._COMPACT.clear()
    assert again == patterns.compact(nested("B"), UNITS)


def test_covering_coordinates_are_shared_read_only():
    patterns._COVERING.clear()
    w, r = glob("T", U * 16 + J, 1, 16), glob("T", U * 16 + J, 1, 16)
    c, covered = patterns.covering_coords(w, UNITS, r, UNITS, P, None)
    again = patterns.covering_coords(glob("T2", U * 16 + J, 1, 16), UNITS, glob("T2", U * 16 + J, 1, 16), UNITS, P, None)
    assert again[1] is covered and covered.all()
    with pytest.raises(ValueError):
        covered[0, 0] = False


def test_a_composed_move_found_before_gets_the_uid_asked_for(monkeypatch):
    merge_split._SPLIT_MOVES.clear()
    calls = _counting(monkeypatch, merge_split, "_split_move_now")
    wop = GOp(Move(), (glob("X", U * 16 + J, 1, 16),), (glob("T", U * 16 + J, 1, 16),), U.lt(32))
    rop = GOp(Move(), (glob("T", U * 16 + J, 1, 16),), (glob("Z", U * 16 + J, 1, 16),))
    ops = [merge_split._split_move(rop, wop, Coords(U, I, J), U.lt(32), uid, UNITS, {}) for uid in (7, 9)]
    assert [op.uid for op in ops] == [7, 9] and ops[0] == ops[1] and len(calls) == 1


def _concat_read_twice(last_row_written: bool, constant: bool = False):
    """Two writers concatenate rows of X and X2 into T; the first reader copies T's first K rows,
    the second all of them (the last row written by nobody unless `last_row_written`)."""
    from powerfusion.gir.ir import Sync
    from tests.rewrite.util import gbuf, graph
    units, k, w = 64, 40, 16
    row = lambda name: glob(name, U * w + J, 1, w)
    end = units if last_row_written else units - 1
    ops = [GOp(Move(), (row("X"),), (row("T"),), U.lt(k)),
           GOp(Move(), (glob("X2", (U - k) * w + J, 1, w),), (row("T"),), binop("le", k, U) & U.lt(end)),
           GOp(Sync(Scope.DEVICE), (row("T"), row("T")), (row("T"),)),
           GOp(Move(), (row("T"),), (row("Z1"),), U.lt(k)),
           GOp(Move(), (row("T"),), (row("Z2"),))]
    bufs = [gbuf("X", k * w), gbuf("X2", (units - k) * w), gbuf("T", units * w), gbuf("Z1", units * w),
            gbuf("Z2", units * w)]
    g = graph(ops, bufs, ["X", "X2"], ["Z1", "Z2"], units=units)
    if constant:   # a constant nothing here loads (Swin's attention subgraphs hold some)
        from dataclasses import replace as _replace
        g = _replace(g, buffers=g.buffers + (gbuf("C", 4),), inputs=g.inputs + ("C",),
                     constants=(("C", np.zeros(4, np.float32)),))
    return g


def test_the_split_rule_builds_no_composed_move_before_every_reader_s_choice_holds(monkeypatch):
    calls = _counting(monkeypatch, merge_split, "_split_move")
    assert merge_split.compose_split(_concat_read_twice(last_row_written=False), 3) is None
    assert calls == []   # the second reader's uncovered row is found before the first reader's moves
    assert merge_split.compose_split(_concat_read_twice(last_row_written=True), 3) is not None
    assert len(calls) == 3   # the first reader's part of X, the second's of X and of X2


def test_a_confirmation_is_remembered_in_a_graph_with_constants_nothing_loads(monkeypatch):
    merge_split._CONFIRMED.clear()
    calls = _counting(monkeypatch, merge_split, "_confirm")
    g = _concat_read_twice(last_row_written=True, constant=True)
    from powerfusion.rewrite.base import active_units, consts
    units = {k: active_units(g, g.ops[k]) for k in (0, 1, 4)}
    chosen = [(0, Coords(U, I, J), U.lt(40)), (1, Coords(U, I, J), binop("le", 40, U))]
    answers = [merge_split._confirmed(g, 4, chosen, units, consts(g)) for _ in range(2)]
    assert answers == [True, True] and len(calls) == 1


def test_a_promotion_s_window_key_lists_every_op_outside_that_names_the_group():
    """sync_rules._window_key finds the ops outside the window through the graph's index; the
    same ones, in the same order, as a scan of every op (on the worked examples' rewrites)."""
    from powerfusion.frontend import import_model, partition_graph
    from powerfusion.rewrite import clear_memo, optimise
    from powerfusion.rewrite.sync_rules import _window_key
    from powerfusion.templates.merge import lower_subgraph
    from tests.rewrite import example_models as M
    checked = 0
    for model in (M.residual_layernorm, M.scale_mask_softmax, M.channel_shuffle):
        graph = import_model(model())
        for sub in partition_graph(graph, "cuda").subgraphs:
            clear_memo()
            _, trace = optimise(lower_subgraph(sub, graph, None, target="cuda"))
            for g in [s.before for s in trace]:
                for b in {s.buffer for op in g.ops for s in op.inputs + op.outputs}:
                    key = _window_key(g, [b])
                    if key is None:
                        continue
                    lo, hi = key[-1], key[-1] + len(key[1]) - 1
                    scan = tuple((k - lo, op) for k, op in enumerate(g.ops) if not lo <= k <= hi
                                 and any(sl.buffer == b for sl in op.inputs + op.outputs))
                    assert key[2] == scan
                    checked += 1
    assert checked > 50


def test_a_reader_s_valid_mask_over_the_sample_is_evaluated_once(monkeypatch):
    merge_split._VALID.clear()
    calls = _counting(monkeypatch, merge_split, "eval_over")
    s = glob("T", U * 16 + J, 1, 16, valid=(U * 16 + J).lt(1000))
    masks = [merge_split._valid_over(s, UNITS, {}) for _ in range(2)]
    assert masks[0] is masks[1] and len(calls) == 1
    assert masks[0].shape == (64, 16) and masks[0].sum() == 1000 and not masks[0].flags.writeable
    assert merge_split._valid_over(glob("T", U * 16 + J, 1, 16), UNITS, {}).all()   # no mask: all valid


def test_a_writer_s_extents_are_worked_out_once_for_all_its_readers(monkeypatch):
    patterns._EXTENTS.clear()
    calls = _counting(monkeypatch, patterns, "_extents")
    w = glob("T", U * 16 + J, 1, 16, valid=J.lt(12))
    got = [patterns._writer_extents(w, UNITS, None), patterns._writer_extents(glob("T2", U * 16 + J, 1, 16, valid=J.lt(12)), UNITS, None)]
    assert got[0] == got[1] == ((1, 12), None) and len(calls) == 1
