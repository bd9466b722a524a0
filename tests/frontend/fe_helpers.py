"""Build one-node ONNX models and compare the frontend (import + numpy executor)
against onnxruntime."""
from __future__ import annotations

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.basic import Subgraph

# tolerances per dtype (rtol, atol): float32 sees only reassociation and erf/exp
# differences; fp16/bf16 are compared with an fp32 reference after rounding inputs
TOL = {"float64": (1e-9, 1e-9), "float32": (1e-5, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (4e-2, 4e-2)}


def make_model(op, feeds: dict, consts: dict | None = None, attrs: dict | None = None, inputs=None,
               outputs=("y",), opset=17, nodes=None, domains=()):
    """One `op` node (or the given `nodes`) over graph inputs `feeds` and initializers `consts`.
    `inputs` orders the node's inputs (names; '' for an absent optional one)."""
    consts = consts or {}
    inputs = list(inputs) if inputs is not None else list(feeds) + list(consts)
    nodes = nodes or [helper.make_node(op, inputs, list(outputs), name=f"{op}_node", **(attrs or {}))]
    g_inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype),
                                              np.shape(v)) for k, v in feeds.items()]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    outs = [o for o in outputs if o]
    graph = helper.make_graph(nodes, "test", g_inputs, [onnx.ValueInfoProto(name=o) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]
                             + [helper.make_opsetid(d, 1) for d in domains])
    model.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type for vi in inferred.graph.value_info}
    types.update({vi.name: vi.type for vi in inferred.graph.output if vi.type.HasField("tensor_type")})
    for vi in model.graph.output:
        if vi.name in types:
            vi.type.CopyFrom(types[vi.name])
        else:  # an op shape inference does not know (tests of unsupported ops)
            vi.type.CopyFrom(model.graph.input[0].type)
    return model


def validate(graph):
    """The basic-graph contract (basic.py): topological order, known tensors, unique names,
    explicit broadcasting, sorted reduce axes."""
    from powerfusion.basic import Elementwise, Reduce
    known = {t.name for t in graph.inputs} | set(graph.constants)
    assert set(graph.constants) <= set(graph.tensors)
    assert len({n.name for n in graph.nodes}) == len(graph.nodes)
    for n in graph.nodes:
        assert set(n.inputs) <= known, f"{n.name} reads {set(n.inputs) - known} before it is produced"
        assert not set(n.outputs) & known, f"{n.name} rewrites {set(n.outputs) & known}"
        known |= set(n.outputs)
        out = graph.tensors[n.outputs[0]]
        if isinstance(n.op, Elementwise):
            assert all(graph.tensors[i].shape == out.shape for i in n.inputs), f"{n.name}: implicit broadcast"
        if isinstance(n.op, Reduce):
            assert list(n.op.axes) == sorted(set(n.op.axes)) and all(a >= 0 for a in n.op.axes)
    assert {t.name for t in graph.outputs} <= known


def run_ours(model, feeds):
    graph = import_model(model)
    validate(graph)
    return graph, run_basic_graph(graph, feeds)


def run_ort(model, feeds):
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def check(model, feeds, rtol=None, atol=None, reference=None):
    """Ours vs onnxruntime (or the given reference dict), output by output, names included."""
    graph, ours = run_ours(model, feeds)
    ref = reference if reference is not None else run_ort(model, feeds)
    assert [t.name for t in graph.outputs] == [o.name for o in model.graph.output]
    for name, want in ref.items():
        got = ours[name]
        assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
        assert got.dtype == np.asarray(want).dtype or reference is not None, f"{name}: {got.dtype} != {want.dtype}"
        r, a = TOL.get(np.dtype(got.dtype).name, (0, 0))
        r, a = rtol if rtol is not None else r, atol if atol is not None else a
        if got.dtype.kind in "fV" or got.dtype.name == "bfloat16":
            np.testing.assert_allclose(got.astype(np.float64), np.asarray(want).astype(np.float64), rtol=r, atol=a,
                                       err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    return graph


def _check_parts_independent(g, s, sub):
    """A subgraph is connected, or horizontally fused: its connected parts are unconnected
    in the whole graph (no path either way, through library calls included)."""
    parts = list(nx.connected_components(sub))
    if len(parts) == 1:
        return
    full = nx.DiGraph()
    consumers = g.consumers()
    full.add_edges_from((n.name, c.name) for n in g.nodes for t in n.outputs for c in consumers.get(t, []))
    full.add_nodes_from(n.name for n in g.nodes)
    for a in parts:
        for b in parts:
            if a is not b:
                reach = set().union(*(nx.descendants(full, x) for x in a))
                assert not (reach & b), f"{s.name}: fused parts {sorted(a)} and {sorted(b)} depend on each other"


def check_partition(p):
    """Every node in exactly one step; steps executable in order; subgraph inputs/outputs exact."""
    g = p.graph
    seen = [n.name for s in p.steps for n in (s.nodes if isinstance(s, Subgraph) else (s.node,))]
    assert sorted(seen) == sorted(n.name for n in g.nodes)
    available = {t.name for t in g.inputs} | set(g.constants)
    consumers = g.consumers()
    graph_outputs = {t.name for t in g.outputs}
    for s in p.steps:
        nodes = s.nodes if isinstance(s, Subgraph) else (s.node,)
        produced = {t for n in nodes for t in n.outputs}
        reads = {t for n in nodes for t in n.inputs} - produced
        assert reads <= available, f"{getattr(s, 'name', s.node.name)} reads {reads - available} before it exists"
        if isinstance(s, Subgraph):
            assert set(s.inputs) == reads
            names = {n.name for n in nodes}
            used_outside = {t for t in produced
                            if t in graph_outputs or any(c.name not in names for c in consumers.get(t, []))}
            assert set(s.outputs) == used_outside
            sub = nx.Graph()
            sub.add_nodes_from(names)
            sub.add_edges_from((p_.name, c.name) for p_ in nodes for t in p_.outputs
                               for c in consumers.get(t, []) if c.name in names)
            _check_parts_independent(g, s, sub)
        available |= produced
    assert [s.name for s in p.subgraphs] == [f"sg{i}" for i in range(len(p.subgraphs))]
