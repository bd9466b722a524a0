"""quantize_weights -> MatMulNBits: onnxruntime, our numpy reference and the typed GEMM agree."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion.ttile.onnx_quant import (dequantize_matmul_to_typed, matmul_nbits_reference,
                                          matmul_nbits_to_typed, quantize_weights)


def _matmul_model(K=96, N=40, M=3, seed=0, dtype=TensorProto.FLOAT):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, N)).astype(np.float32)
    A = helper.make_tensor_value_info("A", dtype, [M, K])
    Y = helper.make_tensor_value_info("Y", dtype, [M, N])
    node = helper.make_node("MatMul", ["A", "W"], ["Y"], name="proj/0")
    g = helper.make_graph([node], "g", [A], [Y], [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10      # what the installed onnxruntime reads
    return m, w


def _consts(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("wtype,group", [("int4", 32), ("uint4", 32), ("int4", 128), ("int8", 64), ("uint2", 32)])
def test_quantize_weights_matches_onnxruntime_and_reference(wtype, group):
    ort = pytest.importorskip("onnxruntime")
    model, w = _matmul_model()
    q = quantize_weights(model, wtype, group)
    onnx.checker.check_model(q)
    node = q.graph.node[0]
    assert node.op_type == "MatMulNBits" and node.domain == "com.microsoft" and "W" not in _consts(q)
    assert node.name.isidentifier()          # model names are sanitised
    A = np.random.default_rng(1).standard_normal((3, 96)).astype(np.float32)
    consts = _consts(q)
    ref = matmul_nbits_reference(node, [A] + [consts.get(n) for n in node.input[1:]])
    try:
        sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:   # older onnxruntime builds lack 2-bit MatMulNBits
        pytest.skip(f"onnxruntime cannot run this MatMulNBits: {e}")
    got = sess.run(None, {"A": A})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # quantisation error against the float model stays moderate
    assert np.abs(ref - A @ w).max() < 0.35 * np.abs(A @ w).max() * (2.0 if "2" in wtype else 1.0)
    # the typed GEMM built from the node computes the same product (fp16 activations)
    mm, packed = matmul_nbits_to_typed(node, consts, M=3, A_dtype="fp16")
    typed = mm.reference(A.astype(np.float16), packed).astype(np.float32)
    ref16 = matmul_nbits_reference(node, [A.astype(np.float16).astype(np.float64)] +
                                   [consts.get(n) for n in node.input[1:]])
    np.testing.assert_allclose(typed, ref16, rtol=2e-3, atol=2e-3 * np.abs(ref16).max())


def test_unsupported_type_is_refused():
    model, _ = _matmul_model()
    with pytest.raises(ValueError, match="MatMulNBits"):
        quantize_weights(model, "nf4", 32)


def test_dequantize_linear_matmul_pattern():
    rng = np.random.default_rng(3)
    K, N = 64, 24
    x = rng.integers(-8, 8, (K, N)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, (K // 32, N)).astype(np.float32)
    dq = helper.make_node("DequantizeLinear", ["x", "s"], ["w"], name="dq", axis=0, block_size=32)
    mmn = helper.make_node("MatMul", ["A", "w"], ["Y"], name="mm")
    mm, packed = dequantize_matmul_to_typed(dq, mmn, {"x": x, "s": s}, M=2)
    A = rng.standard_normal((2, K)).astype(np.float16)
    w = x.astype(np.float32) * np.repeat(s.astype(np.float16).astype(np.float32), 32, 0)
    np.testing.assert_allclose(mm.reference(A, packed).astype(np.float32), A.astype(np.float32) @ w,
                               rtol=2e-3, atol=2e-3 * np.abs(A.astype(np.float32) @ w).max())
