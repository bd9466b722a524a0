"""The driver's termination measure, the graph index and the buffers a rewrite keeps are built
from each op's facts, worked out once per op object (`base.op_facts`): the same values as
walking every slice of every op of every graph, on every graph of real rewrite sequences."""
from __future__ import annotations

import pytest

from powerfusion.frontend import import_model, partition_graph
from powerfusion.gir.ir import Elementwise, Move, Scope, Sync
from powerfusion.gir.traffic import total_bytes, traffic
from powerfusion.rewrite import base, driver, optimise
from powerfusion.templates.merge import enumerate_plans, lower_subgraph
from tests.rewrite import example_models as M


def _measure_walked(g):
    """The measure as it was written before op facts: every slice of every op walked."""
    t = traffic(g)
    weight = sync_weight = sync_slices = 0
    for op in g.ops:
        if isinstance(op.args, Sync):
            sync_weight += 4 ** int(op.args.scope)
            sync_slices += len(op.inputs) + len(op.outputs)
        else:
            weight += sum(4 ** int(s.level) for s in op.inputs + op.outputs)
    n = len(g.ops)
    ew_pos = sum(n - 1 - k for k, op in enumerate(g.ops) if isinstance(op.args, Elementwise))
    return t["global"], total_bytes(t), weight, sync_weight, n, sync_slices, ew_pos, driver._chain_depth(g)


def _index_walked(g):
    writers, readers, moves, loaded, syncs, device = {}, {}, {}, set(), [], []
    for k, op in enumerate(g.ops):
        if isinstance(op.args, Sync):
            syncs.append(k)
            if op.args.scope == Scope.DEVICE:
                device.append(k)
            continue
        for s in op.outputs:
            writers.setdefault(s.buffer, []).append(k)
        gathered = base.op_loads(op)
        loaded |= gathered
        for name in dict.fromkeys([s.buffer for s in op.inputs] + sorted(gathered)):
            readers.setdefault(name, []).append(k)
        if isinstance(op.args, Move):
            moves.setdefault(op.inputs[0].buffer, []).append(k)
    return writers, readers, moves, loaded, syncs, device


def _graphs(model):
    graph = import_model(model)
    (sub,) = partition_graph(graph, "cuda").subgraphs
    for choice in enumerate_plans(sub, graph, "cuda"):
        driver.clear_memo()
        _, trace = optimise(lower_subgraph(sub, graph, choice, target="cuda"))
        for step in trace:
            yield step.before
            yield step.after


@pytest.mark.parametrize("model", [M.channel_shuffle, M.residual_layernorm, M.scale_mask_softmax])
def test_measure_and_index_from_op_facts_match_walking_every_slice(model):
    seen = 0
    for g in _graphs(model()):
        assert driver.measure(g) == _measure_walked(g)
        idx = base.GraphIndex(g)
        assert (idx.writers, idx.readers, idx.moves_reading, idx.loaded, idx.syncs, idx.device_syncs) == _index_walked(g)
        spare = base.Buffer("unused_spare", g.buffers[0].level, 4, g.buffers[0].dtype)
        keep = set(g.inputs) | set(g.outputs) | {n for n, _ in g.constants}
        for op in g.ops:
            keep |= {s.buffer for s in op.inputs + op.outputs} | base.op_loads(op)
        kept = base.Rewrite(g.ops, g.buffers + (spare,), ()).apply(g)
        assert kept.buffers == tuple(b for b in g.buffers if b.name in keep)   # the spare one dropped
        seen += 1
    assert seen > 0


def test_op_facts_are_worked_out_once_per_op_object():
    g = next(iter(_graphs(M.residual_layernorm())))
    op = g.ops[0]
    assert base.op_facts(op) is base.op_facts(op)
