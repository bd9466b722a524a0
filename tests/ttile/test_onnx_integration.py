"""Quantized ONNX models through the session: com.microsoft.MatMulNBits (from
powerfusion.quantize_weights) and DequantizeLinear -> MatMul become TypedMatMul library calls;
outputs are checked against onnxruntime.

Tolerances (max |y - ref| / max |ref|): fp32 models 1e-5 (both sides dequantise the same
integers and scales and accumulate in fp32 or wider); fp16 models 2e-3 (fp16 rounding of the
hidden activation and output); the CUDA typed GEMM 5e-3 (fp16 activations and fp16 scales,
docs/ttile.md), also for fp32 models, whose activations the CUDA session casts to fp16.
onnxruntime fuses DequantizeLinear -> MatMul into MatMulNBits with int8-quantised activations
by default (session.qdq_matmulnbits_accuracy_level = 4, errors near 1e-2); the comparison asks
it for accuracy level 0 (float activations).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import powerfusion as pf
from powerfusion.errors import UnsupportedOpError
from powerfusion.frontend.basic import TypedMatMul

ort = pytest.importorskip("onnxruntime")

K, H = 64, 128


def mlp_model(dtype=TensorProto.FLOAT, lead=(2, 3)) -> onnx.ModelProto:
    """x [*lead, 64] -> MatMul 64x128 -> Relu -> MatMul 128x64 -> Add bias."""
    rng = np.random.default_rng(0)
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [numpy_helper.from_array((rng.standard_normal((K, H)) * 0.2).astype(npdt), "w1"),
             numpy_helper.from_array((rng.standard_normal((H, K)) * 0.2).astype(npdt), "w2"),
             numpy_helper.from_array((rng.standard_normal(K) * 0.1).astype(npdt), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1/matmul"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["m"], name="fc2/matmul"),
             helper.make_node("Add", ["m", "b2"], ["y"], name="bias")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", dtype, [*lead, K])],
                          [helper.make_tensor_value_info("y", dtype, [*lead, K])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def dq_model(signed=True, blocked=False, zero_point=True, dtype=TensorProto.FLOAT, M=4) -> onnx.ModelProto:
    """DequantizeLinear(int4/uint4 [64, 128] constant) -> MatMul(x, .) -> Relu."""
    rng = np.random.default_rng(1)
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    lo, hi = (-8, 8) if signed else (0, 16)
    qdt = TensorProto.INT4 if signed else TensorProto.UINT4
    sshape = (K // 32, H) if blocked else (H,)
    inits = [helper.make_tensor("wq", qdt, [K, H], rng.integers(lo, hi, K * H).tolist()),
             numpy_helper.from_array((rng.random(sshape) * 0.05 + 0.01).astype(npdt), "ws")]
    ins = ["wq", "ws"]
    if zero_point:
        inits.append(helper.make_tensor("wz", qdt, list(sshape), rng.integers(lo, hi, int(np.prod(sshape))).tolist()))
        ins.append("wz")
    attrs = dict(axis=0, block_size=32) if blocked else dict(axis=1)
    nodes = [helper.make_node("DequantizeLinear", ins, ["w"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "w"], ["m"], name="proj"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "dq", [helper.make_tensor_value_info("x", dtype, [M, K])],
                          [helper.make_tensor_value_info("y", dtype, [M, H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def ort_run(model, feeds):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def feed(model, seed=2):
    vi = model.graph.input[0]
    shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    dt = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
    return {vi.name: np.random.default_rng(seed).standard_normal(shape).astype(dt)}


def typed_calls(sess) -> list:
    return [c for c in sess.partition.library_calls if isinstance(c.node.op, TypedMatMul)]


@pytest.mark.parametrize("wtype,group,dtype,tol", [
    ("int4", 32, TensorProto.FLOAT, 1e-5), ("uint4", 32, TensorProto.FLOAT, 1e-5), ("int8", 64, TensorProto.FLOAT, 1e-5),
    ("int4", 32, TensorProto.FLOAT16, 2e-3)])
def test_matmulnbits_model_cpu_matches_onnxruntime(wtype, group, dtype, tol):
    q = pf.quantize_weights(mlp_model(dtype), wtype, group)
    assert [n.op_type for n in q.graph.node].count("MatMulNBits") == 2
    sess = pf.InferenceSession(q, target="cpu")
    calls = typed_calls(sess)
    assert [c.node.op.source for c in calls] == ["MatMulNBits"] * 2
    assert len(sess.partition.library_calls) == 2          # nothing else became a library call
    x = feed(q)
    y = sess.run(None, x)[0]
    ref = ort_run(q, x)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= tol
    # the numpy reference executor of basic graphs agrees with the session
    from powerfusion.frontend import run_basic_graph
    np.testing.assert_array_equal(run_basic_graph(sess.graph, x)["y"], y)


@pytest.mark.parametrize("signed,blocked,zero_point", [
    (True, False, True), (True, True, True), (False, False, True), (False, True, True), (True, True, False)])
def test_dequantize_matmul_cpu_matches_onnxruntime(signed, blocked, zero_point):
    m = dq_model(signed, blocked, zero_point)
    sess = pf.InferenceSession(m, target="cpu")
    [call] = typed_calls(sess)                  # fused, not folded into a float weight
    op = call.node.op
    assert op.source == "DequantizeLinear" and op.bits == 4 and (op.K, op.N) == (K, H)
    assert op.block_size == (32 if blocked else K)
    x = feed(m)
    assert rel_err(sess.run(None, x)[0], ort_run(m, x)) <= 1e-5


def test_dequantize_matmul_fp16_cpu():
    m = dq_model(signed=False, blocked=True, dtype=TensorProto.FLOAT16)
    x = feed(m)
    assert rel_err(pf.InferenceSession(m, target="cpu").run(None, x)[0], ort_run(m, x)) <= 2e-3


def test_dequantize_linear_outside_the_pattern():
    # x computed at run time: DequantizeLinear is not supported; the error names the node
    nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="dq_runtime")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", TensorProto.INT8, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                          [numpy_helper.from_array(np.array(0.5, np.float32), "s")])
    with pytest.raises(UnsupportedOpError, match="dq_runtime"):
        pf.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), target="cpu")


def test_matmulnbits_with_g_idx_and_other_microsoft_ops_are_reported():
    q = pf.quantize_weights(mlp_model(lead=(4,)), "int4", 32)
    node = q.graph.node[0]
    blocks = K // 32
    q.graph.initializer.append(numpy_helper.from_array(np.repeat(np.arange(blocks, dtype=np.int32), 32), "gidx"))
    node.input.extend(["", "gidx"][len(node.input) - 3:])
    assert list(node.input)[4] == "gidx"
    q.graph.node.append(helper.make_node("FastGelu", ["y"], ["z"], name="gelu", domain="com.microsoft"))
    q.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, K]))
    with pytest.raises(UnsupportedOpError) as e:
        pf.InferenceSession(q, target="cpu")
    text = str(e.value)
    assert "g_idx" in text and node.name in text and "FastGelu" in text and "com.microsoft" in text


def test_inspect_lists_typed_matmul_as_library_call(capsys, tmp_path):
    import powerfusion.cli as cli
    path = tmp_path / "mlp_int4.onnx"
    onnx.save(pf.quantize_weights(mlp_model(lead=(4,)), "int4", 32), path)
    assert cli.main(["-q", "inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    lib = [s for s in report["steps"] if s["kind"] == "library"]
    assert [s["op"] for s in lib] == ["TypedMatMul", "TypedMatMul"]
    # fc1: A 4x64 fp32 + Y 4x128 fp32 + weight at 4 bits + fp32 scales (128 columns x 2 groups)
    assert lib[0]["bytes"] == 4 * 64 * 4 + 4 * 128 * 4 + 64 * 128 // 2 + 128 * 2 * 4
    assert lib[0]["flops"] == 2 * 4 * 128 * 64
    assert cli.main(["-q", "inspect", str(path)]) == 0
    assert "TypedMatMul from MatMulNBits" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["int4_fp16", "uint4_fp32", "dq_blocked"])
def test_typed_gemm_the_cuda_session_builds_matches_cpu(model):
    """What CudaPlanRunner launches, evaluated by the typed GEMM's numpy reference (no GPU)."""
    from powerfusion.backends.cuda.session import typed_gemm
    m = {"int4_fp16": lambda: pf.quantize_weights(mlp_model(TensorProto.FLOAT16), "int4", 32),
         "uint4_fp32": lambda: pf.quantize_weights(mlp_model(), "uint4", 32),
         "dq_blocked": lambda: dq_model(signed=False, blocked=True)}[model]()
    sess = pf.InferenceSession(m, target="cpu")
    env = sess.run_all_tensors(feed(m))
    for call in typed_calls(sess):
        mm, packed = typed_gemm(sess.graph, call.node)
        a = env[call.node.inputs[0]]
        assert (mm.M, mm.K, mm.N) == (int(np.prod(a.shape[:-1])), call.node.op.K, call.node.op.N)
        y = mm.reference(a.astype(np.float16).reshape(mm.M, mm.K), packed)
        assert rel_err(y, env[call.node.outputs[0]].reshape(mm.M, mm.N)) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["int4_fp16", "uint4_fp32", "int8_fp16_m32", "dq_blocked", "dq_column_fp16"])
def test_quantized_models_cuda_match_onnxruntime(model):
    m = {"int4_fp16": lambda: pf.quantize_weights(mlp_model(TensorProto.FLOAT16), "int4", 32),
         "uint4_fp32": lambda: pf.quantize_weights(mlp_model(), "uint4", 32),
         "int8_fp16_m32": lambda: pf.quantize_weights(mlp_model(TensorProto.FLOAT16, lead=(4, 8)), "int8", 64),
         "dq_blocked": lambda: dq_model(signed=False, blocked=True),
         "dq_column_fp16": lambda: dq_model(signed=True, dtype=TensorProto.FLOAT16, M=1)}[model]()
    x = feed(m)
    sess = pf.InferenceSession(m, target="cuda")
    assert typed_calls(sess)
    y = sess.run(None, x)[0]
    ref = ort_run(m, x)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= 5e-3
    assert rel_err(sess.run(None, x)[0], ref) <= 5e-3    # a second run reuses the uploaded weights
