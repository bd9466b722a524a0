"""frontend/gemm_bias.py and the strided attention operands: a fused QKV projection's bias goes
into the GEMM, and the attention reads Q, K and V as strided views of the GEMM's result, so no
memory-bound kernel is left between them; the result is what the decomposed graph computes.

Tolerance: fp16 throughout; the fused ops round once where the decomposed graph rounds after the
product and again after the bias add, and keep the scores in float32: 5e-3 relative to the
output's range (as tests/unit/frontend/test_attention.py)."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from powerfusion.basic import Attention, MatMul
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.attention import fuse_attention, read_through_reshapes, view_reshape
from powerfusion.frontend.gemm_bias import fold_gemm_bias
from powerfusion.pipeline.driver import CompileOptions, front

S, H, D = 16, 2, 16
E = H * D
TOL = 5e-3


def _qkv_model(after: str = "attention", reshapes: int = 1):
    """GPT-2's layer head: x [S, E] @ W [E, 3E] + b, split in three, heads split, causal
    attention, heads merged. after="sigmoid": the projection feeds a Sigmoid instead (no fold)."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((E, 3 * E)) / np.sqrt(E)).astype(np.float16)
    b = rng.standard_normal(3 * E).astype(np.float16)
    inits = [nh.from_array(w, "w"), nh.from_array(b, "b")]
    nodes = [h.make_node("MatMul", ["x", "w"], ["xw"]), h.make_node("Add", ["xw", "b"], ["qkv"])]
    if after == "sigmoid":
        nodes.append(h.make_node("Sigmoid", ["qkv"], ["y"]))
        g = h.make_graph(nodes, "proj", [h.make_tensor_value_info("x", T.FLOAT16, [S, E])],
                         [h.make_tensor_value_info("y", T.FLOAT16, [S, 3 * E])], inits)
        return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    causal = np.where(np.tril(np.ones((S, S), bool)), 0.0, -np.inf).astype(np.float16).reshape(1, 1, S, S)
    inits += [nh.from_array(np.array([1, S, H, D], np.int64), "heads"), nh.from_array(causal, "mask"),
              nh.from_array(np.array(1 / np.sqrt(D), np.float16), "scale"),
              nh.from_array(np.array([S, E], np.int64), "merged"), nh.from_array(np.array([E] * 3, np.int64), "sizes"),
              nh.from_array(np.array([1, S, 3 * E], np.int64), "rows")]
    if reshapes == 2:   # ViT's two views (unflatten, then unsqueeze)
        inits.append(nh.from_array(np.array([S, 1, 3 * E], np.int64), "rows1"))
        nodes.append(h.make_node("Reshape", ["qkv", "rows1"], ["qkv1"]))
    nodes += [h.make_node("Reshape", ["qkv1" if reshapes == 2 else "qkv", "rows"], ["qkv3"]),   # GPT-2's view
              h.make_node("Split", ["qkv3", "sizes"], ["q0", "k0", "v0"], axis=2)]
    for n in "qkv":
        nodes += [h.make_node("Reshape", [f"{n}0", "heads"], [f"{n}1"]),
                  h.make_node("Transpose", [f"{n}1"], [f"{n}2"], perm=[0, 2, 1, 3])]
    nodes += [h.make_node("Transpose", ["k2"], ["kt"], perm=[0, 1, 3, 2]),
              h.make_node("MatMul", ["q2", "kt"], ["s"]), h.make_node("Mul", ["s", "scale"], ["ss"]),
              h.make_node("Add", ["ss", "mask"], ["sm"]), h.make_node("Softmax", ["sm"], ["p"], axis=-1),
              h.make_node("MatMul", ["p", "v2"], ["o"]), h.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ot", "merged"], ["y"])]
    g = h.make_graph(nodes, "qkv", [h.make_tensor_value_info("x", T.FLOAT16, [S, E])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [S, E])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)


def _feeds():
    return {"x": np.random.default_rng(8).standard_normal((S, E)).astype(np.float16)}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("reshapes", [1, 2])
def test_qkv_bias_goes_into_the_gemm_and_the_split_into_the_attention(reshapes):
    graph = import_model(_qkv_model(reshapes=reshapes))
    want = run_basic_graph(graph, _feeds())["y"]
    fused = copy.deepcopy(graph)
    assert fuse_attention(fused) == 1
    assert fold_gemm_bias(fused, "cuda") == 1
    assert read_through_reshapes(fused) == 3 * reshapes   # the views of [S, 3E] the split read
    mm, att = fused.nodes            # nothing memory-bound is left between them
    assert isinstance(mm.op, MatMul) and mm.op.bias and mm.inputs == ("x", "w", "b")
    assert isinstance(att.op, Attention) and att.inputs[:3] == (mm.outputs[0],) * 3
    assert [v[0] for v in att.op.in_views] == [0, E, 2 * E]          # Q, K, V: thirds of each row
    assert all(tuple(v[1]) == (1, H, S, D) and tuple(v[2])[1:] == (D, 3 * E, 1) for v in att.op.in_views)
    assert _rel(run_basic_graph(fused, _feeds())["y"], want) < TOL


def test_the_cuda_front_end_leaves_no_memory_bound_subgraph():
    part = front(_qkv_model(), "cuda", CompileOptions())
    assert not part.subgraphs
    assert [type(c.node.op) for c in part.library_calls] == [MatMul, Attention]
    off = front(_qkv_model(), "cuda", CompileOptions(gemm_bias=False))
    assert not any(c.node.op.bias for c in off.library_calls if isinstance(c.node.op, MatMul))
    cpu = front(_qkv_model(), "cpu", CompileOptions())
    assert not any(isinstance(c.node.op, MatMul) and c.node.op.bias for c in cpu.library_calls)


def test_a_bias_feeding_arithmetic_stays_in_the_kernel():
    graph = import_model(_qkv_model(after="sigmoid"))
    assert fold_gemm_bias(graph, "cuda") == 0


def _convnext_tail(perm=(0, 3, 1, 2)):
    """ConvNeXt's block tail: Linear (MatMul + bias) over NHWC, permuted back to NCHW, scaled per
    channel and added to the block's input. perm=(0, 2, 1, 3) keeps the bias axis last."""
    rng = np.random.default_rng(3)
    n, hw, c = 1, 4, 8
    inits = [nh.from_array((rng.standard_normal((4 * c, c)) / 8).astype(np.float16), "w"),
             nh.from_array(rng.standard_normal(c).astype(np.float16), "b"),
             nh.from_array(rng.standard_normal((c, 1, 1)).astype(np.float16), "gamma")]
    out = [n, c, hw, hw] if tuple(perm) == (0, 3, 1, 2) else [n, hw, hw, c]
    nodes = [h.make_node("MatMul", ["x", "w"], ["xw"]), h.make_node("Add", ["xw", "b"], ["z"]),
             h.make_node("Transpose", ["z"], ["zt"], perm=list(perm)),
             h.make_node("Mul", ["zt", "gamma" if out[1] == c else "zt"], ["s"]),
             h.make_node("Add", ["s", "r"], ["y"])]
    g = h.make_graph(nodes, "tail", [h.make_tensor_value_info("x", T.FLOAT16, [n, hw, hw, 4 * c]),
                                     h.make_tensor_value_info("r", T.FLOAT16, out)],
                     [h.make_tensor_value_info("y", T.FLOAT16, out)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)


def _tail_feeds(model):
    rng = np.random.default_rng(4)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float16)
            for i in model.graph.input}


def test_a_bias_read_across_its_axis_by_a_transpose_goes_into_the_gemm():
    """ConvNeXt: the permute back to NCHW reads z across the bias axis, so the add would be a
    kernel of its own; it goes into the GEMM and the result is unchanged."""
    model = _convnext_tail()
    graph = import_model(model)
    want = run_basic_graph(graph, _tail_feeds(model))["y"]
    assert fold_gemm_bias(graph, "cuda") == 1
    mm = next(n for n in graph.nodes if isinstance(n.op, MatMul))
    assert mm.op.bias and mm.inputs[2] == "b"
    assert _rel(run_basic_graph(graph, _tail_feeds(model))["y"], want) < TOL


def test_a_transpose_keeping_the_bias_axis_last_leaves_the_add_in_the_kernel():
    graph = import_model(_convnext_tail(perm=(0, 2, 1, 3)))
    assert fold_gemm_bias(graph, "cuda") == 0


def test_the_compiled_cuda_plan_matches_onnxruntime_on_the_interpreter():
    ort = pytest.importorskip("onnxruntime")
    from powerfusion.compiler import compile_model
    from tests.reliability.plan_interpreter import run_plan
    model = _qkv_model()
    plan = compile_model(model, "cuda", codegen=False)
    got = run_plan(plan, _feeds())["y"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _rel(got, sess.run(None, _feeds())[0]) < TOL


def test_view_reshape_agrees_with_numpy():
    """view_reshape gives numpy's no-copy reshape wherever numpy makes a view, and otherwise
    either None or strides that still read the reshaped values (checked by value)."""
    rng = random.Random(0)
    for _ in range(2000):
        shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4))]
        x = np.arange(int(np.prod(shape))).reshape(shape).transpose(rng.sample(range(len(shape)), len(shape)))
        if rng.random() < 0.5 and x.shape[-1] > 1:
            x = x[..., : x.shape[-1] // 2]
        factors, m = [], x.size
        for p in (2, 3):
            while m % p == 0 and rng.random() < 0.7:
                factors.append(p)
                m //= p
        factors += [m] if m > 1 else []
        k = rng.randint(1, max(1, len(factors)))
        new = [int(np.prod(factors[i::k])) for i in range(k)]
        if rng.random() < 0.3:
            new.insert(rng.randint(0, len(new)), 1)
        got = view_reshape(x.shape, tuple(s // x.itemsize for s in x.strides), tuple(new))
        numpy_views = _numpy_views(x, tuple(new))
        assert got is not None or not numpy_views, (x.shape, x.strides, new)
        if got is not None:
            z = np.lib.stride_tricks.as_strided(x, tuple(new), tuple(g * x.itemsize for g in got))
            assert np.array_equal(z, x.reshape(new)), (x.shape, x.strides, new, got)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_fused_qkv_on_cuda_matches_onnxruntime(cuda_graph):
    ort = pytest.importorskip("onnxruntime")
    from powerfusion import InferenceSession
    model = _qkv_model()
    sess = InferenceSession(model.SerializeToString(), target="cuda", options={"cuda_graph": cuda_graph})
    got = sess.run(None, _feeds())[0]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]
    assert _rel(got, ref) < TOL
    assert not any("bias" in why for why in sess.fallbacks.values()), sess.fallbacks


@pytest.mark.gpu
def test_convnext_tail_on_cuda_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    from powerfusion import InferenceSession
    model = _convnext_tail()
    feeds = _tail_feeds(model)
    sess = InferenceSession(model.SerializeToString(), target="cuda", options={"cuda_graph": True})
    got = sess.run(None, feeds)[0]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert _rel(got, ref) < TOL
    assert not sess.fallbacks, sess.fallbacks


def _numpy_views(x: np.ndarray, new: tuple) -> bool:
    """numpy's own no-copy reshape rule: whether `x` reshapes to `new` as a view."""
    try:
        np.reshape(x, new, copy=False)
        return True
    except ValueError:
        return False
    except TypeError:   # numpy < 2.1 has no copy argument: setting the shape refuses a copy instead
        y = x.view()
        try:
            y.shape = new
            return True
        except AttributeError:
            return False
