"""Random DAGs of elementwise ops and matmuls (some compute-bound on the CPU target, some not):
the partition is complete, executable in order, acyclic once contracted, and maximal (two
adjacent subgraphs are only kept apart when merging them would make a cycle)."""
import networkx as nx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

from tests.frontend.fe_helpers import check_partition, make_model
from powerfusion.frontend import import_model, partition_graph
from powerfusion.basic import Subgraph

N = 256  # a 256^3 matmul is compute-bound on "cpu" (intensity 42 > ridge 20); a 1x256 GEMV is not


@st.composite
def random_model(draw):
    nodes, tensors = [], ["x"]
    consts = {"w": np.full((N, N), 0.01, np.float32)}
    for i in range(draw(st.integers(2, 12))):
        kind = draw(st.sampled_from(["relu", "add", "matmul", "exp"]))
        a = draw(st.sampled_from(tensors))
        if kind == "add":
            b = draw(st.sampled_from(tensors))
            nodes.append(helper.make_node("Add", [a, b], [f"t{i}"], name=f"n{i}"))
        elif kind == "matmul":
            nodes.append(helper.make_node("MatMul", [a, "w"], [f"t{i}"], name=f"n{i}"))
        else:
            nodes.append(helper.make_node(kind.capitalize(), [a], [f"t{i}"], name=f"n{i}"))
        tensors.append(f"t{i}")
    # every tensor nobody reads is an output, so that no node is dead
    read = {i for n in nodes for i in n.input}
    outputs = [t for t in tensors[1:] if t not in read]
    rows = draw(st.sampled_from([1, N]))
    return make_model(None, {"x": np.zeros((rows, N), np.float32)}, consts, nodes=nodes, outputs=outputs)


def step_graph(p):
    owner = {}
    for k, s in enumerate(p.steps):
        for n in (s.nodes if isinstance(s, Subgraph) else (s.node,)):
            owner[n.name] = k
    q = nx.DiGraph()
    q.add_nodes_from(range(len(p.steps)))
    producer = p.graph.producer()
    for n in p.graph.nodes:
        for t in n.inputs:
            if t in producer and owner[producer[t].name] != owner[n.name]:
                q.add_edge(owner[producer[t].name], owner[n.name])
    return q


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_model())
def test_partition_is_acyclic_and_maximal(model):
    p = partition_graph(import_model(model), "cpu")
    check_partition(p)
    q = step_graph(p)
    assert nx.is_directed_acyclic_graph(q)
    subs = {k for k, s in enumerate(p.steps) if isinstance(s, Subgraph)}
    for u, v in q.edges:
        if u in subs and v in subs:
            # kept apart: another path u -> ... -> v must exist
            others = q.copy()
            others.remove_edge(u, v)
            assert nx.has_path(others, u, v), f"{p.steps[u].name} and {p.steps[v].name} could merge"
