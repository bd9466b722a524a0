"""frontend/attention.py: softmax(Q K^T s + bias) V, decomposed by the importer, becomes one
Attention library op on CUDA fp16 / bf16 graphs, and computes what the decomposed graph does.

Tolerance: both graphs in fp16 with float32 softmax; the fused op keeps the scores in float32
where the decomposed graph rounds them to fp16 after the product (and after the bias add), so
the outputs differ by a few fp16 ulps of the scores: 5e-3 relative to the output's range."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from powerfusion.basic import Attention, MatMul, Reshape, Transpose
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.attention import fuse_attention

B, H, S, D = 1, 2, 8, 16
TOL = 5e-3


def _model(dtype=np.float16, guard=False, mask="rows", head=D, extra_use=False, merge=False):
    """BERT-style (Div by sqrt(D), an additive mask) or, with `guard`, GPT-2-style (a causal
    [S, S] mask and the exporters' where(isnan(p), 0, p))."""
    et = T.FLOAT16 if dtype == np.float16 else T.FLOAT
    inits = [nh.from_array(np.array(np.sqrt(head), dtype), "sqrt_d"), nh.from_array(np.array(0, dtype), "zero")]
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             h.make_node("MatMul", ["q", "kt"], ["s"]),
             h.make_node("Div", ["s", "sqrt_d"], ["ss"])]
    if mask == "causal":
        causal = np.where(np.tril(np.ones((S, S), bool)), 0.0, -np.inf).astype(dtype)
        inits.append(nh.from_array(causal.reshape(1, 1, S, S), "mask"))
        nodes.append(h.make_node("Add", ["ss", "mask"], ["sm"]))
    else:
        inits.append(nh.from_array(np.where(np.arange(S) < S - 2, 0.0, -1e4).astype(dtype).reshape(1, 1, 1, S), "mask"))
        nodes.append(h.make_node("Add", ["ss", "mask"], ["sm"]))
    nodes.append(h.make_node("Softmax", ["sm"], ["p"], axis=-1))
    p = "p"
    if guard:
        nodes += [h.make_node("IsNaN", ["p"], ["nan"]), h.make_node("Where", ["nan", "zero", "p"], ["pg"])]
        p = "pg"
    if merge:   # heads merged back: [B, H, S, D] -> [B, S, H * D]
        inits.append(nh.from_array(np.array([B, S, H * head], np.int64), "merged"))
        nodes += [h.make_node("MatMul", [p, "v"], ["o"]), h.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
                  h.make_node("Reshape", ["ot", "merged"], ["y"])]
        outputs = [h.make_tensor_value_info("y", et, [B, S, H * head])]
    else:
        nodes.append(h.make_node("MatMul", [p, "v"], ["y"]))
        outputs = [h.make_tensor_value_info("y", et, [B, H, S, head])]
    if extra_use:
        outputs.append(h.make_tensor_value_info("p", et, [B, H, S, S]))
    g = h.make_graph(nodes, "attention", [h.make_tensor_value_info(n, et, [B, H, S, head]) for n in "qkv"],
                     outputs, inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _split_model():
    """GPT-2-style head split: q, k, v stored [B, S, H, D], transposed to [B, H, S, D], q and k
    scaled by s^0.5 each (the exporters' split of the scale), causal mask, heads merged back."""
    hs = np.array(1 / np.sqrt(np.sqrt(D)), np.float16)
    causal = np.where(np.tril(np.ones((S, S), bool)), 0.0, -np.inf).astype(np.float16).reshape(1, 1, S, S)
    inits = [nh.from_array(hs, "hs"), nh.from_array(causal, "mask"),
             nh.from_array(np.array([B, S, H * D], np.int64), "merged")]
    nodes = [h.make_node("Transpose", [f"{n}s"], [f"{n}t"], perm=[0, 2, 1, 3]) for n in "qkv"]
    nodes += [h.make_node("Mul", ["qt", "hs"], ["q"]), h.make_node("Transpose", ["kt"], ["ktt"], perm=[0, 1, 3, 2]),
              h.make_node("Mul", ["ktt", "hs"], ["kts"]), h.make_node("MatMul", ["q", "kts"], ["sc"]),
              h.make_node("Add", ["sc", "mask"], ["sm"]), h.make_node("Softmax", ["sm"], ["p"], axis=-1),
              h.make_node("MatMul", ["p", "vt"], ["o"]), h.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ot", "merged"], ["y"])]
    g = h.make_graph(nodes, "split", [h.make_tensor_value_info(f"{n}s", T.FLOAT16, [B, S, H, D]) for n in "qkv"],
                     [h.make_tensor_value_info("y", T.FLOAT16, [B, S, H * D])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _split_feeds():
    rng = np.random.default_rng(4)
    return {f"{n}s": rng.standard_normal((B, S, H, D)).astype(np.float16) for n in "qkv"}


def test_head_split_and_scale_are_read_through_strides():
    graph = import_model(_split_model())
    want = run_basic_graph(graph, _split_feeds())["y"]
    fused = copy.deepcopy(graph)
    assert fuse_attention(fused) == 1
    assert [type(n.op) for n in fused.nodes] == [Attention]     # no transpose or multiply left
    att = fused.nodes[0]
    assert att.op.in_perms == ((0, 2, 1, 3),) * 3 and att.inputs[:3] == ("qs", "ks", "vs")
    assert att.op.scale == pytest.approx(1 / np.sqrt(D), rel=2e-3)   # s^0.5 twice, in fp16
    assert _rel(run_basic_graph(fused, _split_feeds())["y"], want) < TOL


def _feeds(dtype=np.float16, head=D):
    rng = np.random.default_rng(3)
    return {n: rng.standard_normal((B, H, S, head)).astype(dtype) for n in "qkv"}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("guard,mask,merge", [(False, "rows", False), (True, "causal", False),
                                              (True, "causal", True)])
def test_fused_attention_matches_the_decomposed_graph(guard, mask, merge):
    graph = import_model(_model(guard=guard, mask=mask, merge=merge))
    want = run_basic_graph(graph, _feeds())["y"]
    fused = copy.deepcopy(graph)
    assert fuse_attention(fused) == 1
    (att,) = [n for n in fused.nodes if isinstance(n.op, Attention)]
    assert att.op.scale == pytest.approx(1 / np.sqrt(D), rel=1e-3) and att.op.nan_to_zero == guard
    assert not any(isinstance(n.op, MatMul) for n in fused.nodes)   # both products are inside
    assert len(att.inputs) == 4                                       # q, k, v and the mask
    assert att.op.out_perm == ((0, 2, 1, 3) if merge else ())         # the head merge is written by the op
    assert att.op.out_shape == ((B, S, H * D) if merge else ())
    assert not merge or not any(isinstance(n.op, (Transpose, Reshape)) for n in fused.nodes)
    assert _rel(run_basic_graph(fused, _feeds())["y"], want) < TOL


@pytest.mark.parametrize("case", ["fp32", "head_12", "probabilities_are_an_output"])
def test_not_fused(case):
    kw = {"fp32": {"dtype": np.float32}, "head_12": {"head": 12},
          "probabilities_are_an_output": {"extra_use": True}}[case]
    graph = import_model(_model(**kw))
    assert fuse_attention(graph) == 0


def test_only_cuda_partitions_get_the_fused_op():
    from powerfusion.pipeline.driver import CompileOptions, front
    lib = lambda part: [c.node.op for c in part.library_calls]
    cuda = front(_model(guard=True, mask="causal"), "cuda", CompileOptions())
    assert [type(op) for op in lib(cuda)] == [Attention]
    assert not any(isinstance(op, Attention) for op in lib(front(_model(), "cpu", CompileOptions())))
    off = front(_model(), "cuda", CompileOptions(attention=False))
    assert not any(isinstance(op, Attention) for op in lib(off))


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn", [True, False])
def test_head_split_on_cuda_matches(cudnn, monkeypatch):
    """Q, K, V read through cuDNN's strides from their [B, S, H, D] storage, the output written
    [B, S, H * D]; or the stand-in."""
    import powerfusion
    from powerfusion.backends.cuda import cudnn_conv
    if not cudnn:
        monkeypatch.setattr(cudnn_conv, "load", lambda: (None, "switched off by the test"))
    model = _split_model()
    want = run_basic_graph(import_model(model), _split_feeds())["y"]
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(model.SerializeToString(), target="cuda")
        got = sess.run(None, _split_feeds())[0]
    assert (len(sess._executor.attentions) == 1) == cudnn, sess._executor.fallbacks
    assert _rel(got, want) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn", [True, False])
@pytest.mark.parametrize("guard,mask,merge", [(False, "rows", False), (True, "causal", False),
                                              (True, "causal", True)])
def test_attention_on_cuda_matches(cudnn, guard, mask, merge, monkeypatch):
    """cuDNN's fused attention inside the captured graph, or (cuDNN switched off, or a mask
    broadcast over rows, which cuDNN's bias does not take) the cuBLAS + CuPy stand-in."""
    import powerfusion
    from powerfusion.backends.cuda import cudnn_conv
    if not cudnn:
        monkeypatch.setattr(cudnn_conv, "load", lambda: (None, "switched off by the test"))
    model = _model(guard=guard, mask=mask, merge=merge)
    want = run_basic_graph(import_model(model), _feeds())["y"]
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(model.SerializeToString(), target="cuda")
        got = sess.run(None, _feeds())[0]
        again = sess.run(None, _feeds())[0]
    runner = sess._executor
    on_cudnn = cudnn and mask == "causal"
    assert (len(runner.attentions) == 1) == on_cudnn, runner.fallbacks
    assert _rel(got, want) < TOL and _rel(again, want) < TOL


BB = 2   # batch of the per-batch / per-head bias cases


def _bias_model(bias_shape):
    """softmax(q k^T / sqrt(D) + bias) v over [BB, H, S, D], the bias a graph input of
    `bias_shape`: BERT's padding mask per sequence [BB, 1, S, S], a per-head bias [1, H, S, S]."""
    inits = [nh.from_array(np.array(np.sqrt(D), np.float16), "sqrt_d")]
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), h.make_node("MatMul", ["q", "kt"], ["s"]),
             h.make_node("Div", ["s", "sqrt_d"], ["ss"]), h.make_node("Add", ["ss", "bias"], ["sm"]),
             h.make_node("Softmax", ["sm"], ["p"], axis=-1), h.make_node("MatMul", ["p", "v"], ["y"])]
    ins = [h.make_tensor_value_info(n, T.FLOAT16, [BB, H, S, D]) for n in "qkv"]
    ins.append(h.make_tensor_value_info("bias", T.FLOAT16, list(bias_shape)))
    g = h.make_graph(nodes, "biased", ins, [h.make_tensor_value_info("y", T.FLOAT16, [BB, H, S, D])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _bias_feeds(bias_shape):
    rng = np.random.default_rng(9)
    feeds = {n: rng.standard_normal((BB, H, S, D)).astype(np.float16) for n in "qkv"}
    feeds["bias"] = np.where(rng.random(bias_shape) < 0.2, -1e4, rng.standard_normal(bias_shape)).astype(np.float16)
    return feeds


BIAS_SHAPES = [(1, 1, S, S), (BB, 1, S, S), (1, H, S, S), (BB, H, S, S)]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
def test_a_bias_per_batch_or_per_head_goes_to_cudnn(bias_shape):
    """attention_shape (no GPU needed) hands cuDNN a rank-4 bias broadcast over batch or heads
    as it is stored; a [1, 1, 1, S] row mask (broadcast over rows) is still refused."""
    from powerfusion.backends.cuda.cudnn_attention import attention_shape
    graph = import_model(_bias_model(bias_shape))
    assert fuse_attention(graph) == 1
    node = next(n for n in graph.nodes if isinstance(n.op, Attention))
    shape, why = attention_shape(graph, node)
    assert why == "" and shape.bias == bias_shape
    rows = import_model(_bias_model((1, 1, 1, S)))
    fuse_attention(rows)
    node = next(n for n in rows.nodes if isinstance(n.op, Attention))
    assert "broadcast over rows" in attention_shape(rows, node)[1]


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
def test_a_bias_per_batch_or_per_head_on_cuda_matches(bias_shape):
    """cuDNN inside the captured graph (no stand-in), against the decomposed graph."""
    import powerfusion
    model = _bias_model(bias_shape)
    feeds = _bias_feeds(bias_shape)
    want = run_basic_graph(import_model(model), feeds)["y"]
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(model.SerializeToString(), target="cuda")
        got = sess.run(None, feeds)[0]
    assert len(sess._executor.attentions) == 1 and not sess._executor.fallbacks, sess._executor.fallbacks
    assert _rel(got, want) < TOL
