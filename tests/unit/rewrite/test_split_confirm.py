"""The split rule's confirmation over every reader unit (merge_split._confirm) looks only at the
units that decide it (gir/periodic.py) and still refuses a choice that is wrong at one unit."""
from __future__ import annotations

import pytest

from powerfusion.gir.expr import I, J, U, binop
from powerfusion.gir.ir import GOp, Move, Scope, Sync
from powerfusion.gir.periodic import deciding_units
from powerfusion.rewrite.base import active_units
from powerfusion.rewrite.merge_split import _confirm, _confirm_predicates
from powerfusion.rewrite.patterns import Coords
from tests.rewrite.util import gbuf, glob, graph, reg

W, UNITS, K = 64, 4096, 2999   # rows of 64; units below K copy X, the others X2 (a concat)


def _concat_then_copy():
    row = lambda name: glob(name, U * W + J, 1, W)
    wa = GOp(Move(), (row("X"),), (row("T"),), U.lt(K))
    wb = GOp(Move(), (glob("X2", (U - K) * W + J, 1, W),), (row("T"),), binop("le", K, U))
    ops = [wa, wb, GOp(Sync(Scope.DEVICE), (row("T"), row("T")), (row("T"),)), GOp(Move(), (row("T"),), (reg("y", 1, W),)),
           GOp(Move(), (reg("y", 1, W),), (row("Z"),))]
    bufs = [gbuf("X", K * W), gbuf("X2", (UNITS - K) * W), gbuf("T", UNITS * W), gbuf("Z", UNITS * W), gbuf("y", W)]
    g = graph(ops, bufs, ["X", "X2"], ["Z"], units=UNITS)
    return g, {k: active_units(g, g.ops[k]) for k in (0, 1, 3)}


def test_the_right_choice_is_confirmed_on_a_few_units():
    g, units = _concat_then_copy()
    chosen = [(0, Coords(U, I, J), U.lt(K)), (1, Coords(U, I, J), binop("le", K, U))]
    assert _confirm(g, 3, chosen, units, {})
    deciding = deciding_units(units[3], _confirm_predicates(g, 3, chosen, units), 1, W)
    assert deciding is not None and len(deciding) * 16 < UNITS


@pytest.mark.parametrize("wrong", [
    (U.lt(K), binop("le", K + 1, U)),                # the second writer's condition misses row K
    (U.lt(K) & binop("ne", U, 1234), binop("le", K, U)),       # the first one's misses row 1234, far from the ends
    (U.lt(K), binop("le", K, U) & binop("ne", J, 17)),         # one column of every row of the second writer
])
def test_a_choice_wrong_at_one_unit_is_refused(wrong):
    g, units = _concat_then_copy()
    chosen = [(0, Coords(U, I, J), wrong[0]), (1, Coords(U, I, J), wrong[1])]
    assert not _confirm(g, 3, chosen, units, {})
