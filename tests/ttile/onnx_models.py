"""Small quantized ONNX models shared by the session tests and the device precompile step."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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


def dq_model(signed=True, blocked=False, zero_point=True, dtype=TensorProto.FLOAT, M=4, bits=4,
             k=K, n=H, block=32) -> onnx.ModelProto:
    """DequantizeLinear(int/uint 4 or 8-bit [k, n] constant) -> MatMul(x [M, k], .) -> Relu."""
    rng = np.random.default_rng(1)
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    qdt = {(4, True): TensorProto.INT4, (4, False): TensorProto.UINT4,
           (8, True): TensorProto.INT8, (8, False): TensorProto.UINT8}[bits, signed]
    sshape = (-(-k // block), n) if blocked else (n,)
    widen = 16 / (hi - lo) * 8 / np.sqrt(k)    # outputs of the same order for every width and k
    inits = [helper.make_tensor("wq", qdt, [k, n], rng.integers(lo, hi, k * n).tolist()),
             numpy_helper.from_array(((rng.random(sshape) * 0.05 + 0.01) * widen).astype(npdt), "ws")]
    ins = ["wq", "ws"]
    if zero_point:
        inits.append(helper.make_tensor("wz", qdt, list(sshape), rng.integers(lo, hi, int(np.prod(sshape))).tolist()))
        ins.append("wz")
    attrs = dict(axis=0, block_size=block) if blocked else dict(axis=1)
    nodes = [helper.make_node("DequantizeLinear", ins, ["w"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "w"], ["m"], name="proj"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "dq", [helper.make_tensor_value_info("x", dtype, [M, k])],
                          [helper.make_tensor_value_info("y", dtype, [M, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def nbits_model(wtype="uint4", lead=(3,), k=200, n=72, group=32, dtype=TensorProto.FLOAT16,
                float_zero_points=False, bias=False) -> onnx.ModelProto:
    """One MatMulNBits (from quantize_weights) over x [*lead, k]; optionally its zero points as
    floats of the scales' type ((q - zp) * scale with a fractional zp) and a bias input."""
    from powerfusion.ttile.onnx_quant import quantize_weights
    from powerfusion.ttile.quant import unpack_bits
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")
    g = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("x", dtype, [*lead, k])],
                          [helper.make_tensor_value_info("y", dtype, [*lead, n])],
                          [numpy_helper.from_array(w.astype(helper.tensor_dtype_to_np_dtype(dtype)), "w")])
    q = quantize_weights(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
                         wtype, group)
    node, inits = q.graph.node[0], {t.name: t for t in q.graph.initializer}
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    if float_zero_points:
        blocks, bits = -(-k // group), int(wtype[-1])
        zp = unpack_bits(numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1), bits, blocks)
        fz = (zp.astype(np.float32) + rng.uniform(-0.5, 0.5, zp.shape)).astype(npdt).reshape(-1)
        inits[node.input[3]].CopyFrom(numpy_helper.from_array(fz, node.input[3]))
    if bias:
        q.graph.initializer.append(numpy_helper.from_array((rng.standard_normal(n) * 0.5).astype(npdt), "proj_bias"))
        node.input.extend([""] * (5 - len(node.input)) + ["proj_bias"])
    return q


def to_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model with bf16 activations, scales and output (a float32 model's MatMulNBits)."""
    import ml_dtypes
    m = onnx.ModelProto.FromString(model.SerializeToString())
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for t in m.graph.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(ml_dtypes.bfloat16), t.name))
    return m


def ort_run(model, feeds):
    """onnxruntime CPU, asked for float activations in MatMulNBits (accuracy level 0)."""
    import onnxruntime as ort
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


def _q(wtype, group, dtype=TensorProto.FLOAT, lead=(2, 3)):
    from powerfusion.ttile.onnx_quant import quantize_weights
    return lambda: quantize_weights(mlp_model(dtype, lead), wtype, group)


F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT
# name -> (model builder, the kernels the CUDA session must pick for its typed GEMMs)
CUDA_SESSION_MODELS = {
    "int4_fp16_m6": (_q("int4", 32, F16), {"gemv"}),
    "uint4_fp32_m6": (_q("uint4", 32), {"gemv"}),
    "int8_fp16_m32": (_q("int8", 64, F16, (4, 8)), {"mma"}),
    "int4_fp32_m35": (_q("int4", 32, F32, (5, 7)), {"mma"}),
    "uint2_fp16_m1024": (_q("uint2", 32, F16, (32, 32)), {"dequant"}),
    "uint4_float_zp_bias_fp16_m3": (lambda: nbits_model("uint4", (3,), float_zero_points=True, bias=True), {"gemv"}),
    "int4_bias_fp32_m40": (lambda: nbits_model("int4", (4, 10), dtype=F32, bias=True), {"mma"}),
    "int4_g128_fp16_m40": (_q("int4", 128, F16, (4, 10)), {"tc"}),   # the prefill kernel (K 64: per channel)
    "uint8_bias_fp32_m300": (lambda: nbits_model("uint8", (300,), k=512, n=256, group=64, dtype=F32, bias=True),
                             {"dequant"}),
    "dq_uint4_blocked_fp32_m4": (lambda: dq_model(signed=False, blocked=True), {"gemv"}),
    "dq_int4_column_fp16_m1": (lambda: dq_model(signed=True, dtype=F16, M=1), {"gemv"}),
    "dq_uint8_blocked_fp16_m64": (lambda: dq_model(signed=False, blocked=True, dtype=F16, M=64, bits=8, block=64),
                                  {"mma"}),
    "dq_int8_column_fp32_m300": (lambda: dq_model(signed=True, zero_point=False, M=300, bits=8, k=512, n=256),
                                 {"dequant"}),
}
# bf16 models: onnxruntime's CPU provider has no bf16 MatMulNBits; the reference is numpy
CUDA_BF16_MODELS = {
    "int4_bf16_m5": (lambda: to_bf16(nbits_model("int4", (5,), dtype=F32)), {"gemv"}),
    "uint4_bf16_m48": (lambda: to_bf16(nbits_model("uint4", (48,), dtype=F32, bias=True)), {"mma"}),
}


def session_matmuls():
    """The typed GEMMs a CUDA session builds for these models (the device precompile step
    compiles them ahead of the tests)."""
    import powerfusion as pf
    from powerfusion.backends.cuda.session import typed_gemm
    from powerfusion.basic import TypedMatMul
    for build, _ in {**CUDA_SESSION_MODELS, **CUDA_BF16_MODELS}.values():
        sess = pf.InferenceSession(build(), target="cpu")
        for call in sess.partition.library_calls:
            if isinstance(call.node.op, TypedMatMul):
                yield typed_gemm(sess.graph, call.node)[0]
