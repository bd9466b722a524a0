"""frontend/parallel_gemm.py: MatMuls of one activation by constant weights become one MatMul
and slices, with their bias adds merged too; typed GEMMs (MatMulNBits / MatMulLowBit) of one
activation become one typed GEMM over their constants side by side; the graph computes what it did
(typed: exactly, the same codes and scales per output column).

Tolerance: fp16, the same dot products accumulated in float32 and rounded once either way, the
same bias adds: 1e-3 relative to the output's range (the reference interpreter may sum in another
order for another matrix width); 5e-3 against onnxruntime, whose fp16 SiLU rounds in between."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from powerfusion.basic import Elementwise, MatMul, Slice, TypedMatMul
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.parallel_gemm import merge_parallel_matmuls
from powerfusion.pipeline.driver import CompileOptions, front

S, K = 64, 64
WIDTHS = (64, 16, 16)
TOL = 1e-3


def _model(bias: bool, swiglu: bool = False, dtype=np.float16):
    """x [S, K] times three weights (q, k, v of grouped-query widths), each + bias where asked;
    swiglu: two weights, silu(x W1) * (x W2) (LLaMA's MLP)."""
    et = T.FLOAT16 if dtype == np.float16 else T.FLOAT
    rng = np.random.default_rng(5)
    widths = (48, 48) if swiglu else WIDTHS
    inits, nodes, outs = [], [], []
    for i, n in enumerate(widths):
        inits.append(nh.from_array((rng.standard_normal((K, n)) / np.sqrt(K)).astype(dtype), f"w{i}"))
        nodes.append(h.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]))
        out = f"p{i}"
        if bias:
            inits.append(nh.from_array(rng.standard_normal(n).astype(dtype), f"b{i}"))
            nodes.append(h.make_node("Add", [f"p{i}", f"b{i}"], [f"y{i}"]))
            out = f"y{i}"
        outs.append(out)
    if swiglu:
        nodes += [h.make_node("Sigmoid", [outs[0]], ["sg"]), h.make_node("Mul", [outs[0], "sg"], ["silu"]),
                  h.make_node("Mul", ["silu", outs[1]], ["out"])]
        outputs = [h.make_tensor_value_info("out", et, [S, widths[0]])]
    else:
        outputs = [h.make_tensor_value_info(o, et, [S, n]) for o, n in zip(outs, widths)]
    g = h.make_graph(nodes, "parallel", [h.make_tensor_value_info("x", et, [S, K])], outputs, inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)


def _feeds(dtype=np.float16):
    return {"x": np.random.default_rng(6).standard_normal((S, K)).astype(dtype)}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("bias,swiglu", [(False, False), (True, False), (False, True)])
def test_merged_gemm_computes_the_same(bias, swiglu):
    graph = import_model(_model(bias, swiglu))
    want = run_basic_graph(graph, _feeds())
    merged = copy.deepcopy(graph)
    assert merge_parallel_matmuls(merged, "cuda") == (1 if swiglu else 2)
    mms = [n for n in merged.nodes if isinstance(n.op, MatMul)]
    assert len(mms) == 1 and graph.constants  # one product over the weights side by side
    assert mms[0].inputs[0] == "x" and merged.tensors[mms[0].outputs[0]].shape[-1] == (96 if swiglu else sum(WIDTHS))
    assert sum(isinstance(n.op, Slice) for n in merged.nodes) == (2 if swiglu else 3)
    adds = [n for n in merged.nodes if isinstance(n.op, Elementwise) and n.op.fn == "add"]
    assert len(adds) == (1 if bias else 0)      # the biases concatenated into one add
    got = run_basic_graph(merged, _feeds())
    for name in want:
        assert _rel(got[name], want[name]) < TOL, name


def test_the_cuda_front_end_merges_and_folds_the_bias():
    part = front(_model(bias=True), "cuda", CompileOptions())
    (mm,) = [c.node for c in part.library_calls]
    assert isinstance(mm.op, MatMul) and mm.op.bias          # merged, then the bias in its epilogue
    off = front(_model(bias=True), "cuda", CompileOptions(merge_matmuls=False))
    assert len(off.library_calls) == 3
    cpu = front(_model(bias=True), "cpu", CompileOptions())
    assert len(cpu.library_calls) == 3


def test_different_activations_or_run_time_weights_are_not_merged():
    graph = import_model(_model(bias=False))
    first = next(n for n in graph.nodes if isinstance(n.op, MatMul))
    graph.constants.pop(first.inputs[1])    # a weight computed at run time: not a constant
    assert merge_parallel_matmuls(graph, "cuda") == 1   # the other two still merge


def test_the_compiled_cuda_plan_matches_onnxruntime_on_the_interpreter():
    ort = pytest.importorskip("onnxruntime")
    from powerfusion.compiler import compile_model
    from tests.reliability.plan_interpreter import run_plan
    model = _model(bias=False, swiglu=True)
    plan = compile_model(model, "cuda", codegen=False)
    got = run_plan(plan, _feeds())["out"]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]
    assert _rel(got, ref) < 5e-3   # fp16 SiLU in float32 vs onnxruntime's fp16 ops


@pytest.mark.gpu
@pytest.mark.parametrize("bias,swiglu", [(True, False), (False, True)])
def test_merged_gemm_on_cuda_matches_onnxruntime(bias, swiglu):
    ort = pytest.importorskip("onnxruntime")
    from powerfusion import InferenceSession
    model = _model(bias, swiglu)
    sess = InferenceSession(model.SerializeToString(), target="cuda", options={"cuda_graph": True})
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, _feeds())
    for got, want in zip(sess.run(None, _feeds()), ref):
        assert _rel(got, want) < 5e-3


def _typed_model(dtype: str, act=None, group=32):
    """_model's q / k / v (swiglu=False, no bias) after `powerfusion quantize-weights`."""
    from powerfusion.cli.cmd_quantize_weights import quantize_weights_model
    return quantize_weights_model(_model(bias=False), dtype, group, act)


@pytest.mark.parametrize("dtype,act", [("int4", None), ("nf4", None), ("int2", "int8"), ("fp8_e4m3", None)])
def test_typed_gemms_merge_exactly(dtype, act):
    model, op_type = _typed_model(dtype, act)
    graph = import_model(model)
    want = run_basic_graph(graph, _feeds())
    merged = copy.deepcopy(graph)
    assert merge_parallel_matmuls(merged, "cuda") == 2
    (typed,) = [n for n in merged.nodes if isinstance(n.op, TypedMatMul)]
    assert typed.op.source == op_type and typed.op.N == sum(WIDTHS) == dict(typed.op.attrs)["N"]
    assert sum(isinstance(n.op, Slice) for n in merged.nodes) == 3
    got = run_basic_graph(merged, _feeds())
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_typed_gemms_of_other_types_or_blocks_stay_apart():
    from powerfusion.cli.cmd_quantize_weights import quantize_weights_model
    from powerfusion.ttile.onnx_quant import quantize_weights
    one = quantize_weights(_model(bias=False), "int4", 32)
    two = quantize_weights(_model(bias=False), "int4", 64)
    nodes = [n for n in one.graph.node if n.op_type == "MatMulNBits"]
    other = [n for n in two.graph.node if n.op_type == "MatMulNBits"][0]   # w0 at block 64
    names = {t.name for t in one.graph.initializer}
    one.graph.initializer.extend(t for t in two.graph.initializer if t.name in other.input and t.name not in names)
    one.graph.node.remove(nodes[0])
    one.graph.node.insert(0, other)
    graph = import_model(one)
    assert merge_parallel_matmuls(graph, "cuda") == 1   # the two block-32 GEMMs only
    nf4, _ = quantize_weights_model(_model(bias=False), "nf4", 32, None)
    assert merge_parallel_matmuls(import_model(nf4), "cpu") == 2   # the rewrite itself knows no target
    assert len(front(_typed_model("int4")[0], "cpu", CompileOptions()).library_calls) == 3
    assert len(front(_typed_model("int4")[0], "cuda", CompileOptions()).library_calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,act", [("int4", None), ("nf4", None), ("int2", "int8")])
def test_merged_typed_gemm_on_cuda_matches_the_cpu_session(dtype, act):
    """The merged typed GEMM on CUDA against the CPU session (unmerged, numpy reference):
    fp16 GEMVs over K = 64, 2e-3 of the output's range (W2A8: the same int8 rows both sides)."""
    from powerfusion import InferenceSession
    model, _ = _typed_model(dtype, act)
    x = {"x": _feeds()["x"][:1]}
    one_row = _typed_model_rows(model, 1)
    cuda = InferenceSession(one_row.SerializeToString(), target="cuda", options={"cuda_graph": True})
    assert sum(isinstance(s.call.node.op, TypedMatMul) for s in cuda._executor.plan.library_steps) == 1
    cpu = InferenceSession(one_row.SerializeToString(), target="cpu")
    for got, want in zip(cuda.run(None, x), cpu.run(None, x)):
        assert _rel(got, want) < 2e-3


def _typed_model_rows(model, rows: int):
    """The model with `rows` rows of x (a decode step: the typed GEMV path)."""
    for vi in [*model.graph.input, *model.graph.output]:
        vi.type.tensor_type.shape.dim[0].dim_value = rows
    return model
