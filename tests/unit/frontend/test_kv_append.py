"""frontend/kv_append.py: a decode step's attention over Concat(cache, new rows) reads the cache
and the new rows in place (Attention.kv_tail); the graph computes what it did (the interpreter
concatenates them: equal to the unfused graph's numbers within fp16 rounding of the output,
2e-3 of its range), and attentions the decode kernel would not take, or whose Concat is read
elsewhere, keep the Concat."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from powerfusion.basic import Attention, Concat
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.attention import fuse_attention
from powerfusion.frontend.kv_append import fold_kv_append
from powerfusion.pipeline.driver import CompileOptions, front

B, H, PAST, D = 2, 3, 40, 32


def _model(axis: int = 2, rows: int = 1, keys_out: bool = False, heads: int = D):
    """q [B, H, 1, D] over cat(past, new) along `axis` of K and V; keys_out: the K Concat is a
    graph output too."""
    f16 = T.FLOAT16
    kv = [B, H, PAST, heads]
    new = [B, H, rows, heads] if axis == 2 else [B, 1, PAST, heads]   # axis 1: one more head
    qh = H if axis == 2 else H + 1
    nodes = [h.make_node("Concat", ["past_k", "new_k"], ["keys"], axis=axis),
             h.make_node("Concat", ["past_v", "new_v"], ["vals"], axis=axis),
             h.make_node("Transpose", ["keys"], ["kt"], perm=[0, 1, 3, 2]),
             h.make_node("MatMul", ["q", "kt"], ["s0"]),
             h.make_node("Mul", ["s0", "scale"], ["s"]),
             h.make_node("Softmax", ["s"], ["p"], axis=-1),
             h.make_node("MatMul", ["p", "vals"], ["y"])]
    inputs = [h.make_tensor_value_info("q", f16, [B, qh, 1, heads]),
              *[h.make_tensor_value_info(n, f16, kv) for n in ("past_k", "past_v")],
              *[h.make_tensor_value_info(n, f16, new) for n in ("new_k", "new_v")]]
    outputs = [h.make_tensor_value_info("y", f16, [B, qh, 1, heads])]
    if keys_out:
        outputs.append(h.make_tensor_value_info("keys", f16, [B, H, PAST + rows, heads]))
    scale = nh.from_array(np.array(1 / math.sqrt(heads), np.float16), "scale")
    g = h.make_graph(nodes, "decode", inputs, outputs, [scale])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)


def _feeds(model):
    rng = np.random.default_rng(3)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float16)
            for i in model.graph.input}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("rows", [1, 3])
def test_attention_reads_the_appended_rows_in_place(rows):
    model = _model(rows=rows)
    feeds = _feeds(model)
    want = run_basic_graph(import_model(model), feeds)["y"]
    graph = import_model(model)
    assert fuse_attention(graph) == 1
    assert fold_kv_append(graph) == 1
    (att,) = graph.nodes
    assert isinstance(att.op, Attention) and att.op.kv_tail == rows
    assert att.inputs[1:] == ("past_k", "past_v", "new_k", "new_v")
    assert not any(isinstance(n.op, Concat) for n in graph.nodes) and "keys" not in graph.tensors
    assert _rel(run_basic_graph(graph, feeds)["y"], want) < 2e-3


def test_the_cuda_front_end_folds_and_the_cpu_one_does_not():
    (att,) = [c.node for c in front(_model(), "cuda", CompileOptions()).library_calls]
    assert att.op.kv_tail == 1
    assert not front(_model(), "cpu", CompileOptions()).library_calls


@pytest.mark.parametrize("case", ["keys read elsewhere", "joined along the heads", "head size 48"])
def test_other_concats_stay(case):
    model = {"keys read elsewhere": lambda: _model(keys_out=True),
             "joined along the heads": lambda: _model(axis=1),
             "head size 48": lambda: _model(heads=48)}[case]()
    graph = import_model(model)
    assert fuse_attention(graph) == 1
    assert fold_kv_append(graph) == 0
    assert sum(isinstance(n.op, Concat) for n in graph.nodes) == 2
