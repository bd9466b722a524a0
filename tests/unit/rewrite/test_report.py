"""The traffic model and the GIR report / inspect JSON contract (docs/gir-json.md)."""
from __future__ import annotations

import json

from powerfusion.gir.expr import J, U
from powerfusion.gir.ir import Elementwise, GOp, Level, MemorySlice, Move, Scope, Sync
from powerfusion.gir.report import gir_report
from powerfusion.pipeline.inspect import inspect_gir
from powerfusion.gir.traffic import kernel_count, traffic
from powerfusion.rewrite import optimise
from tests.rewrite import example_models as M
from tests.unit.rewrite.test_driver import relu_then_add
from tests.rewrite.util import gbuf, glob, graph, reg

LEVELS = {"global", "shared", "register"}


def test_traffic_counts_each_slice_once_at_its_level_and_syncs_as_nothing():
    C = 4
    row = lambda n: glob(n, U * C + J, 1, C)
    ops = [GOp(Move(), (row("X"),), (reg("x", 1, C),)), GOp(Elementwise("relu"), (reg("x", 1, C),), (reg("y", 1, C),)),
           GOp(Move(), (reg("y", 1, C),), (row("T"),)), GOp(Sync(Scope.DEVICE), (row("T"),), (row("T"),)),
           GOp(Move(), (row("T"),), (row("Z"),))]
    g = graph(ops, [gbuf("X", 16), gbuf("T", 16), gbuf("Z", 16), gbuf("x", 4, Level.REGISTER), gbuf("y", 4, Level.REGISTER)], ["X"], ["Z"])
    n = 16 * 4   # bytes of one float32 tensor over the 4 units
    assert traffic(g) == {"global": 4 * n, "shared": 0, "register": 4 * n}
    assert kernel_count(g) == 2


def test_traffic_skips_masked_elements_and_inactive_units():
    ops = [GOp(Move(), (MemorySlice("X", Level.GLOBAL, U * 4 + J, 1, 4, "float32", valid=J.lt(3)),),
               (reg("x", 1, 4),), U.lt(2))]
    g = graph(ops, [gbuf("X", 16), gbuf("x", 4, Level.REGISTER)], ["X"], [])
    assert traffic(g) == {"global": 2 * 3 * 4, "shared": 0, "register": 2 * 4 * 4}


def test_gir_report_fields():
    before = relu_then_add()
    after, trace = optimise(before)
    r = gir_report("relu_add", [("relu", "elementwise.rows"), ("add", "elementwise.rows")], before, after, trace)
    assert r["name"] == "relu_add" and r["kernels"] == 1 and r["kernels_before"] == 2
    assert set(r["bytes"]["before"]) == LEVELS and set(r["bytes"]["after"]) == LEVELS
    assert r["bytes"]["after"]["global"] < r["bytes"]["before"]["global"]
    assert r["syncs"]["before"] == {"device": 1} and r["syncs"].get("after", {}) == {}
    assert r["gops"]["before"]["elementwise"] == 2 and r["gops"]["after"]["elementwise"] == 2
    assert r["trace_length"] == len(trace) == sum(r["rules"].values())
    assert r["templates"][0] == {"node": "relu", "template": "elementwise.rows"}


def test_inspect_gir_json_contract():
    r = inspect_gir(M.scale_mask_softmax(2, 8))
    json.dumps(r)   # plain JSON types only
    assert r["subgraphs"]
    for e in r["subgraphs"]:
        assert isinstance(e["name"], str) and isinstance(e["kernels"], int) and e["kernels"] >= 1
        for side in ("before", "after"):
            assert set(e["bytes"][side]) == LEVELS and all(isinstance(v, int) for v in e["bytes"][side].values())
    assert r["kernels"] == sum(e["kernels"] for e in r["subgraphs"])
    best = inspect_gir(M.scale_mask_softmax(2, 8), plans=16)
    assert best["kernels"] <= r["kernels"]
