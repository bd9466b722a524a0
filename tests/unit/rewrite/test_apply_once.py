"""A rule's own traffic check and the driver's step apply the same rewrite to the same graph and
ask for its traffic one after the other: the second asks are answered from the first."""
from __future__ import annotations

from powerfusion.gir import traffic as T
from powerfusion.gir.expr import J, U
from powerfusion.gir.ir import GOp, Move
from powerfusion.rewrite.base import Rewrite
from tests.rewrite.util import gbuf, glob, graph


def _copy_twice():
    row = lambda name: glob(name, U * 8 + J, 1, 8)
    ops = (GOp(Move(), (row("X"),), (row("T"),), uid=1), GOp(Move(), (row("T"),), (row("Z"),), uid=2))
    g = graph(ops, [gbuf("X", 32), gbuf("T", 32), gbuf("Z", 32)], ["X"], ["Z"])
    one = Rewrite((GOp(Move(), (row("X"),), (row("Z"),), uid=3),), g.buffers, (1, 2))
    return g, one


def test_the_same_rewrite_of_the_same_graph_is_applied_once():
    g, rw = _copy_twice()
    first = rw.apply(g)
    assert rw.apply(g) is first
    assert [b.name for b in first.buffers] == ["X", "Z"]   # T is no longer used
    other = Rewrite(g.ops, g.buffers, ())
    assert other.apply(g) is not first and other.apply(g).ops == g.ops


def test_traffic_after_the_same_step_is_worked_out_once(monkeypatch):
    g, rw = _copy_twice()
    new = rw.apply(g)
    calls = []
    real = T._traffic_after
    monkeypatch.setattr(T, "_traffic_after", lambda *a: calls.append(a) or real(*a))
    before = T.traffic(g)
    a, b = T.traffic_after(g, before, new), T.traffic_after(g, before, new)
    assert a == b == T.traffic(new) and a is not b and len(calls) == 1
    assert T.traffic_after(g, {**before, "global": before["global"] + 4}, new)["global"] == a["global"] + 4
    assert len(calls) == 2   # another traffic before: worked out again
