import numpy as np
import pytest
from onnx import helper

from tests.frontend.fe_helpers import check_partition, make_model
from powerfusion.frontend import import_model, partition_graph
from powerfusion.basic import LibraryCall
from powerfusion.frontend.partition import node_bytes, node_flops
from powerfusion.targets.specs import get_target

R = np.random.default_rng(3)


def f(*s):
    return R.standard_normal(s).astype(np.float32)


def test_gemv_is_memory_bound():
    g = import_model(make_model("MatMul", {"x": f(1, 1024)}, {"w": f(1024, 1024)}))
    for target in ("cpu", "h100", "mi250"):
        p = partition_graph(g, target)
        check_partition(p)
        assert not p.library_calls and [n.op.__class__.__name__ for n in p.subgraphs[0].nodes] == ["MatMul"]


def test_gpu_gemv_over_a_large_weight_is_a_library_call():
    """A weight of >= 8 MiB (LLaMA-7B's 4096 x 4096 fp16: 32 MiB) goes to cuBLAS on GPUs, where
    GIR's GEMV template streamed it at a third of cuBLAS's speed; the CPU keeps it generated, and
    an activation x activation GEMV (decode attention) stays GIR's on every target."""
    x, w = f(1, 4096).astype(np.float16), f(4096, 4096).astype(np.float16)
    g = import_model(make_model("MatMul", {"x": x}, {"w": w}))
    assert len(partition_graph(g, "h200").library_calls) == 1
    assert not partition_graph(g, "cpu").library_calls
    g = import_model(make_model("MatMul", {"x": x, "w": w}))   # w an input, not a weight
    assert not partition_graph(g, "h200").library_calls


def test_decode_attention_scores_are_memory_bound():
    # one query against a KV cache of 512 positions: batched GEMV
    g = import_model(make_model("MatMul", {"q": f(8, 1, 64), "k": f(8, 64, 512)}))
    assert not partition_graph(g, "h100").library_calls


def test_shared_weight_batch_folds_into_gemm_rows():
    # a channels-last linear: 7 rows per product, but the weight is shared, so one 49-row GEMM
    # (fp16: its intensity is below the ridge point, so only the template question decides)
    g = import_model(make_model("MatMul", {"x": f(1, 7, 7, 768).astype(np.float16)}, {"w": f(768, 3072).astype(np.float16)}))
    (call,) = partition_graph(g, "h200").steps
    assert isinstance(call, LibraryCall)
    # a batch of independent products of few rows each stays a batched GEMV
    g = import_model(make_model("MatMul", {"x": f(7, 2, 64)}, {"w": f(7, 64, 64)}))
    assert not partition_graph(g, "h200").library_calls


def test_big_matmul_is_a_library_call():
    g = import_model(make_model("MatMul", {"a": f(512, 512), "b": f(512, 512)}))
    p = partition_graph(g, "cpu")
    check_partition(p)
    (call,) = p.steps
    assert isinstance(call, LibraryCall) and call.flops == 2 * 512 ** 3
    assert call.bytes == 3 * 512 * 512 * 4
    assert call.intensity > get_target("cpu").ridge_point("float32")


def test_depthwise_conv_memory_bound_dense_conv_library():
    x = {"x": f(1, 64, 56, 56)}
    dw = import_model(make_model("Conv", x, {"w": f(64, 1, 3, 3)}, {"group": 64, "pads": [1, 1, 1, 1]}))
    dense = import_model(make_model("Conv", x, {"w": f(64, 64, 3, 3)}, {"pads": [1, 1, 1, 1]}))
    for target in ("cpu", "h100"):
        assert len(partition_graph(dense, target).library_calls) == 1
    assert not partition_graph(dw, "h100").library_calls
    # on the CPU the driver's direct depthwise conv runs it (faster than the template's C)
    assert len(partition_graph(dw, "cpu").library_calls) == 1
    conv = dense.nodes[0]
    assert node_flops(dense, conv) == 2 * 64 * 56 * 56 * 64 * 9


def _residual_model():
    """x -> relu -> a; a @ W -> b (library); exp(a) -> c; y = b + c."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("MatMul", ["a", "w"], ["b"], name="mm"),
             helper.make_node("Exp", ["a"], ["c"], name="exp"),
             helper.make_node("Add", ["b", "c"], ["y"], name="add")]
    return make_model(None, {"x": f(256, 256)}, {"w": f(256, 256)}, nodes=nodes)


def test_subgraphs_stay_acyclic_around_a_library_call():
    p = partition_graph(import_model(_residual_model()), "cpu")
    check_partition(p)
    kinds = [type(s).__name__ for s in p.steps]
    assert kinds == ["Subgraph", "LibraryCall", "Subgraph"]
    first, _, last = p.steps
    assert {n.origin.node for n in first.nodes} == {"relu", "exp"}
    assert first.inputs == ("x",) and set(first.outputs) == {"a", "c"}
    assert {n.origin.node for n in last.nodes} == {"add"} and last.outputs == ("y",)


def test_groups_merge_when_no_cycle():
    # relu(x) does not feed the library call, so it joins the add after it
    nodes = [helper.make_node("MatMul", ["x", "w"], ["b"], name="mm"),
             helper.make_node("Relu", ["x"], ["c"], name="relu"),
             helper.make_node("Add", ["b", "c"], ["y"], name="add")]
    p = partition_graph(import_model(make_model(None, {"x": f(256, 256)}, {"w": f(256, 256)}, nodes=nodes)), "cpu")
    check_partition(p)
    assert [type(s).__name__ for s in p.steps] == ["LibraryCall", "Subgraph"]
    assert {n.origin.node for n in p.subgraphs[0].nodes} == {"relu", "add"}
    assert set(p.subgraphs[0].inputs) == {"x", "b"}


def test_subgraph_cost_is_compulsory_traffic():
    p = partition_graph(import_model(make_model("Softmax", {"x": f(4, 1000)})), "cpu")
    (sg,) = p.subgraphs
    assert sg.bytes == 2 * 4 * 1000 * 4  # read x once, write y once
    assert sg.flops == sum(node_flops(p.graph, n) for n in sg.nodes) > 0
    assert all(node_bytes(p.graph, n) > 0 for n in sg.nodes)


@pytest.mark.parametrize("target", ["cpu", "a100", "mlu370"])
def test_partition_properties_on_a_cnn(target):
    import os

    import onnx
    path = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light/light_squeezenet.onnx")
    p = partition_graph(import_model(path), target)
    check_partition(p)
    assert p.library_calls and p.subgraphs


def test_frontend_partition_is_only_the_module():
    """One name, one thing: `frontend.partition` is the module, its function `partition_graph`."""
    import importlib

    import powerfusion.frontend as fe
    module = importlib.import_module("powerfusion.frontend.partition")
    assert fe.partition is module and fe.partition_graph is module.partition_graph


def test_independent_groups_of_one_level_share_a_subgraph():
    # horizontal fusion: relu(x) and exp(z) are unconnected, both before any library call
    nodes = [helper.make_node("Relu", ["x"], ["y1"], name="relu"),
             helper.make_node("Exp", ["z"], ["y2"], name="exp")]
    p = partition_graph(import_model(make_model(None, {"x": f(4, 8), "z": f(4, 16)}, nodes=nodes, outputs=("y1", "y2"))),
                  "cpu")
    check_partition(p)
    (sg,) = p.subgraphs
    assert {n.origin.node for n in sg.nodes} == {"relu", "exp"} and set(sg.outputs) == {"y1", "y2"}


def test_independent_groups_of_different_levels_stay_apart():
    # relu(mm(x)) waits for the library call; exp(z) need not, so they are not fused
    nodes = [helper.make_node("MatMul", ["x", "w"], ["b"], name="mm"),
             helper.make_node("Relu", ["b"], ["y1"], name="relu"),
             helper.make_node("Exp", ["z"], ["y2"], name="exp")]
    p = partition_graph(import_model(make_model(None, {"x": f(256, 256), "z": f(4, 16)}, {"w": f(256, 256)}, nodes=nodes,
                                          outputs=("y1", "y2"))), "cpu")
    check_partition(p)
    assert sorted(sorted(n.origin.node for n in s.nodes) for s in p.subgraphs) == [["exp"], ["relu"]]


def test_fused_parts_stay_below_the_node_cap(monkeypatch):
    import importlib
    monkeypatch.setattr(importlib.import_module("powerfusion.frontend.partition"), "HFUSE_MAX_NODES", 1)
    nodes = [helper.make_node("Relu", ["x"], ["y1"], name="relu"),
             helper.make_node("Exp", ["z"], ["y2"], name="exp")]
    p = partition_graph(import_model(make_model(None, {"x": f(4, 8), "z": f(4, 16)}, nodes=nodes, outputs=("y1", "y2"))),
                  "cpu")
    check_partition(p)
    assert len(p.subgraphs) == 2
