"""frontend/layout.py: fp16 / bf16 2-D convolutions rewritten to channels-last compute the same
values as the NCHW graph (numpy reference executor, both graphs in fp16: the only difference is
the order of accumulation, so the tolerance is fp16's, 2e-3 relative to the output's range), and
between two convolutions of a residual block no layout change is left."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from powerfusion.basic import Conv, Transpose
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.layout import to_channels_last


def _resblock(dtype=np.float16, depthwise=False, c=8):
    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.standard_normal((c, 1 if depthwise else c, 3, 3)) * 0.2).astype(dtype), "w1"),
             nh.from_array((rng.standard_normal((c, c, 3, 3)) * 0.2).astype(dtype), "w2"),
             nh.from_array(rng.standard_normal(c).astype(dtype), "b2"),
             nh.from_array((rng.random(c) + 0.5).astype(dtype), "scale"),
             nh.from_array(rng.standard_normal(c).astype(dtype), "bias"),
             nh.from_array(rng.standard_normal(c).astype(dtype), "mean"),
             nh.from_array((rng.random(c) + 0.5).astype(dtype), "var"),
             nh.from_array((rng.standard_normal((4, c)) * 0.3).astype(dtype), "fc")]
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], group=c if depthwise else 1),
             h.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"]),
             h.make_node("Relu", ["bn"], ["r"]),
             h.make_node("Conv", ["r", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             h.make_node("Add", ["c2", "r"], ["s"]),
             h.make_node("Relu", ["s"], ["r2"]),
             h.make_node("ReduceMean", ["r2"], ["pool"], axes=[2, 3], keepdims=1),
             h.make_node("Flatten", ["pool"], ["flat"]),
             h.make_node("Gemm", ["flat", "fc"], ["y"], transB=1)]
    et = T.FLOAT16 if dtype == np.float16 else T.FLOAT
    g = h.make_graph(nodes, "resblock", [h.make_tensor_value_info("x", et, [2, c, 10, 12])],
                     [h.make_tensor_value_info("y", et, [2, 4]), ], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_channels_last_resblock_matches_and_leaves_no_transpose_between_convs():
    graph = import_model(_resblock())
    x = np.random.default_rng(1).standard_normal((2, 8, 10, 12)).astype(np.float16)
    want = run_basic_graph(graph, {"x": x})["y"]
    cl = copy.deepcopy(graph)
    assert to_channels_last(cl) == 2
    convs = [n for n in cl.nodes if isinstance(n.op, Conv)]
    assert all(n.op.channels_last for n in convs)
    got = run_basic_graph(cl, {"x": x})["y"]
    assert _rel(got, want) < 2e-3
    # the only transposes left: the input's (before the first conv) and the pooled result's
    producer = cl.producer()
    second = convs[1]
    assert not isinstance(producer[second.inputs[0]].op, Transpose), "a layout change is left between the convs"
    assert sum(isinstance(n.op, Transpose) for n in cl.nodes) <= 2


def test_fp32_convs_and_a_depthwise_conv_read_in_nchw_stay_nchw():
    """A depthwise conv goes channels-last only where the model moves its result to NHWC
    (ConvNeXt, below); in a ResNet-style block its BatchNorm reads it as it is."""
    graph = import_model(_resblock(np.float32))
    assert to_channels_last(graph) == 0
    graph = import_model(_resblock(depthwise=True))
    assert to_channels_last(graph) == 1   # the second, ordinary conv only
    dw = [n for n in graph.nodes if isinstance(n.op, Conv) and not n.op.channels_last]
    assert len(dw) == 1 and dw[0].op.group == 8


def _convnext_block(c=16, hw=6):
    """ConvNeXt's block on NCHW: depthwise 7x7 -> permute to NHWC -> LayerNorm -> Linear -> GELU
    -> Linear -> layer scale -> permute back -> residual add, twice (two blocks), then a ReLU."""
    rng = np.random.default_rng(5)
    inits, nodes, x = [], [], "x"
    for b in range(2):
        inits += [nh.from_array((rng.standard_normal((c, 1, 7, 7)) * 0.2).astype(np.float16), f"dw{b}"),
                  nh.from_array(rng.standard_normal(c).astype(np.float16), f"dwb{b}"),
                  nh.from_array((rng.random(c) + 0.5).astype(np.float16), f"g{b}"),
                  nh.from_array(rng.standard_normal(c).astype(np.float16), f"be{b}"),
                  nh.from_array((rng.standard_normal((c, 4 * c)) / 4).astype(np.float16), f"w1{b}"),
                  nh.from_array((rng.standard_normal((4 * c, c)) / 8).astype(np.float16), f"w2{b}"),
                  nh.from_array(rng.standard_normal(c).astype(np.float16), f"b2{b}"),
                  nh.from_array((rng.standard_normal((c, 1, 1)) * 0.5).astype(np.float16), f"ls{b}")]
        nodes += [h.make_node("Conv", [x, f"dw{b}", f"dwb{b}"], [f"d{b}"], pads=[3] * 4, group=c),
                  h.make_node("Transpose", [f"d{b}"], [f"t{b}"], perm=[0, 2, 3, 1]),
                  h.make_node("LayerNormalization", [f"t{b}", f"g{b}", f"be{b}"], [f"n{b}"], axis=-1, epsilon=1e-6),
                  h.make_node("MatMul", [f"n{b}", f"w1{b}"], [f"m{b}"]),
                  h.make_node("Relu", [f"m{b}"], [f"r{b}"]),
                  h.make_node("MatMul", [f"r{b}", f"w2{b}"], [f"o{b}"]),
                  h.make_node("Add", [f"o{b}", f"b2{b}"], [f"ob{b}"]),
                  h.make_node("Transpose", [f"ob{b}"], [f"tb{b}"], perm=[0, 3, 1, 2]),
                  h.make_node("Mul", [f"tb{b}", f"ls{b}"], [f"s{b}"]),
                  h.make_node("Add", [f"s{b}", x], [f"y{b}"])]
        x = f"y{b}"
    nodes.append(h.make_node("Relu", [x], ["out"]))
    g = h.make_graph(nodes, "convnext", [h.make_tensor_value_info("x", T.FLOAT16, [1, c, hw, hw])],
                     [h.make_tensor_value_info("out", T.FLOAT16, [1, c, hw, hw])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_convnext_blocks_run_channels_last_without_layout_changes_inside():
    """With the depthwise convs channels-last the permutes of ConvNeXt's blocks cancel: a
    transpose is left only at the model's input and before its last op (an output's producer
    keeps the output's layout)."""
    graph = import_model(_convnext_block())
    x = np.random.default_rng(6).standard_normal((1, 16, 6, 6)).astype(np.float16)
    want = run_basic_graph(graph, {"x": x})["out"]
    assert to_channels_last(graph) == 2
    moves = [n for n in graph.nodes if isinstance(n.op, Transpose) and n.inputs[0] not in graph.constants]
    assert len(moves) == 2, [n.inputs for n in moves]   # the depthwise weights' reads aside
    assert _rel(run_basic_graph(graph, {"x": x})["out"], want) < 2e-3


def test_channels_last_depthwise_conv_runs_as_a_gir_template():
    """The CUDA pipeline (no GPU needed: the plan's kernels run on the GIR interpreter) keeps
    the channels-last depthwise convs in memory-bound subgraphs (conv.depthwise.cols), and the
    plan computes what the NCHW graph does."""
    from powerfusion.compiler import compile_model
    from tests.reliability.plan_interpreter import run_plan
    model = _convnext_block()
    x = np.random.default_rng(7).standard_normal((1, 16, 6, 6)).astype(np.float16)
    want = run_basic_graph(import_model(model), {"x": x})["out"]
    plan = compile_model(model, "cuda", codegen=False)
    labels = [t for s in plan.kernel_steps for _, t in s.gir.templates]
    assert sum(t.startswith("conv.depthwise.cols") for t in labels) == 2, labels
    assert not any(getattr(s, "op", None) == "conv" for s in plan.library_steps)
    assert _rel(run_plan(plan, {"x": x})["out"], want) < 2e-3


@pytest.mark.parametrize("target", ["cpu-reference", "cpu"])
@pytest.mark.parametrize("depthwise", [False, True])
def test_channels_last_cpu_session_matches(depthwise, target):
    """The whole pipeline with the rewrite applied by hand: on "cpu" the memory-bound
    subgraphs around the NHWC convs run as generated C."""
    graph = import_model(_resblock(depthwise=depthwise))
    x = np.random.default_rng(2).standard_normal((2, 8, 10, 12)).astype(np.float16)
    want = run_basic_graph(graph, {"x": x})["y"]
    to_channels_last(graph)
    from powerfusion.session import InferenceSession
    sess = InferenceSession(graph, target=target)
    assert _rel(sess.run(None, {"x": x})[0], want) < 2e-3


def test_squeeze_excitation_gate_sinks_too():
    """conv -> relu -> mean -> 1x1 conv -> sigmoid -> x * gate -> conv: the gate's broadcast
    moves into NHWC as well, so the last conv reads the product without a layout change."""
    rng = np.random.default_rng(3)
    c = 8
    inits = [nh.from_array((rng.standard_normal((c, c, 3, 3)) * 0.2).astype(np.float16), n) for n in ("w1", "w3")]
    inits.append(nh.from_array((rng.standard_normal((c, c, 1, 1)) * 0.3).astype(np.float16), "wg"))
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c1"], ["r"]),
             h.make_node("ReduceMean", ["r"], ["m"], axes=[2, 3], keepdims=1),
             h.make_node("Conv", ["m", "wg"], ["g"]),
             h.make_node("Sigmoid", ["g"], ["gate"]),
             h.make_node("Mul", ["r", "gate"], ["p"]),
             h.make_node("Conv", ["p", "w3"], ["y"], pads=[1, 1, 1, 1])]
    g = h.make_graph(nodes, "se", [h.make_tensor_value_info("x", T.FLOAT16, [1, c, 6, 7])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [1, c, 6, 7])], inits)
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    x = rng.standard_normal((1, c, 6, 7)).astype(np.float16)
    want = run_basic_graph(graph, {"x": x})["y"]
    assert to_channels_last(graph) == 3
    assert _rel(run_basic_graph(graph, {"x": x})["y"], want) < 2e-3
    producer = graph.producer()
    last = [n for n in graph.nodes if isinstance(n.op, Conv)][-1]
    assert not isinstance(producer[last.inputs[0]].op, Transpose)
    assert sum(isinstance(n.op, Transpose) for n in graph.nodes) == 2   # the input's and the output's


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn", [True, False])
def test_channels_last_on_cuda_matches(cudnn, monkeypatch):
    """The CUDA session runs the rewritten convs through cuDNN in NHWC, or (cuDNN switched off)
    through im2col + cuBLAS on NCHW copies, inside its captured graph; fp16 tolerance."""
    import powerfusion
    from powerfusion.backends.cuda import cudnn_conv
    if not cudnn:
        monkeypatch.setattr(cudnn_conv, "load", lambda: (None, "switched off by the test"))
    model = _resblock(c=32)
    x = np.random.default_rng(5).standard_normal((2, 32, 10, 12)).astype(np.float16)
    want = run_basic_graph(import_model(model), {"x": x})["y"]
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(model.SerializeToString(), target="cuda")
        got = sess.run(None, {"x": x})[0]
        again = sess.run(None, {"x": x})[0]
    convs = [s.call.node for s in sess._executor.plan.library_steps if isinstance(s.call.node.op, Conv)]
    assert convs and all(n.op.channels_last for n in convs)
    runner = sess._executor
    assert (len(runner.convs) == 2) == cudnn, runner.conv_routes
    assert _rel(got, want) < 5e-3 and _rel(again, want) < 5e-3


@pytest.mark.parametrize("target", ["cpu-reference", "cpu"])
def test_pooling_window_runs_channels_last(target):
    """A ResNet stem (conv -> relu -> 3x3/2 max pool -> conv): the pool's window reads the NHWC
    tensor directly (Window.channels_last), so no layout change is left between the convs; the
    generated C of the window template ("cpu") agrees with the reference."""
    rng = np.random.default_rng(6)
    c = 8
    inits = [nh.from_array((rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float16), "w1"),
             nh.from_array((rng.standard_normal((c, c, 3, 3)) * 0.2).astype(np.float16), "w2")]
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("Relu", ["c1"], ["r"]),
             h.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             h.make_node("Conv", ["p", "w2"], ["y"], pads=[1, 1, 1, 1])]
    g = h.make_graph(nodes, "stem", [h.make_tensor_value_info("x", T.FLOAT16, [1, 3, 21, 18])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [1, c, 6, 5])], inits)
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    x = rng.standard_normal((1, 3, 21, 18)).astype(np.float16)
    want = run_basic_graph(graph, {"x": x})["y"]
    assert to_channels_last(graph) == 2
    assert _rel(run_basic_graph(graph, {"x": x})["y"], want) < 2e-3
    from powerfusion.basic import Window
    assert any(isinstance(n.op, Window) and n.op.channels_last for n in graph.nodes)
    producer = graph.producer()
    last = [n for n in graph.nodes if isinstance(n.op, Conv)][-1]
    assert not isinstance(producer[last.inputs[0]].op, Transpose)
    from powerfusion.session import InferenceSession
    got = InferenceSession(graph, target=target).run(None, {"x": x})[0]
    assert _rel(got, want) < 2e-3


def test_patch_embedding_conv_stays_nchw():
    """Kernel == stride without padding (ViT's and ConvNeXt's stems): left to the NCHW routes,
    where the CUDA session times cuDNN against im2col + cuBLAS."""
    rng = np.random.default_rng(0)
    w = nh.from_array((rng.standard_normal((6, 3, 4, 4)) * 0.2).astype(np.float16), "w")
    w3 = nh.from_array((rng.standard_normal((6, 6, 3, 3)) * 0.2).astype(np.float16), "w3")
    nodes = [h.make_node("Conv", ["x", "w"], ["p"], strides=[4, 4]),
             h.make_node("Conv", ["p", "w3"], ["y"], pads=[1, 1, 1, 1])]
    g = h.make_graph(nodes, "stem", [h.make_tensor_value_info("x", T.FLOAT16, [1, 3, 16, 16])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [1, 6, 4, 4])], [w, w3])
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float16)
    want = run_basic_graph(graph, {"x": x})["y"]
    assert to_channels_last(graph) == 1           # the 3x3 conv only
    convs = [n for n in graph.nodes if isinstance(n.op, Conv)]
    assert [n.op.channels_last for n in convs] == [False, True]
    assert _rel(run_basic_graph(graph, {"x": x})["y"], want) < 2e-3
