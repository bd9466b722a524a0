"""`powerfusion quantize-weights`: every weight type quantises a small MatMul model that the CPU
session runs and that matches an independent numpy reference (decode the stored bits with
ml_dtypes / the NF4 table / 2^(e-127), scale, matmul in float64); int4 and int2 also through
onnxruntime's MatMulNBits; bad flags and malformed MatMulLowBit nodes get errors naming them.

Tolerances (max |y - ref| / max |ref|): fp32 models 1e-5 (both sides decode the same codes and
scales and accumulate in float64 or fp32); fp16 models 2e-3 (fp16 rounding of the output and the
hidden activation); onnxruntime 1e-4 (its fp32 accumulation order).
Quantisation error against the float model (max |y_q - y| / max |y|, a sanity bound on the
quantisers, not the feature under test) per type: fp8 0.06, int4 / nf4 0.2, fp4 / mxfp4 0.35,
int2 0.8, int1 1.5 (int1 holds {-1, 0}: positive weights round to 0).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import powerfusion as pf
from powerfusion.cli import main as cli_main
from powerfusion.errors import UnsupportedOpError
from powerfusion.ttile.ttype import NF4_LEVELS

from .onnx_models import feed, mlp_model, ort_run, rel_err

QUANT_ERR = {"fp8_e4m3": 0.06, "int4": 0.2, "nf4": 0.2, "fp4": 0.35, "mxfp4": 0.35, "int2": 0.8, "int1": 1.5}
BITS = {"int4": 4, "int2": 2, "int1": 1, "nf4": 4, "fp4": 4, "mxfp4": 4, "fp8_e4m3": 8}


def _single(K=200, N=72, M=5, dtype=TensorProto.FLOAT):
    """y = x [M, K] @ w [K, N], K not a multiple of any group size."""
    rng = np.random.default_rng(3)
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    w = (rng.standard_normal((K, N)) * 0.1).astype(npdt)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj/0")], "g",
                          [helper.make_tensor_value_info("x", dtype, [M, K])],
                          [helper.make_tensor_value_info("y", dtype, [M, N])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), w


def _quantize(tmp_path, model, *flags) -> onnx.ModelProto:
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    assert cli_main(["quantize-weights", str(src), *flags, "-o", str(dst), "-q"]) == 0
    return onnx.load(dst)


def _codes(blob: np.ndarray, bits: int, N: int, K: int) -> np.ndarray:
    """LSB-first bitstream per row -> codes [N, K] (rows padded to whole blocks)."""
    planes = np.unpackbits(blob.reshape(N, -1), axis=-1, bitorder="little")
    per_row = planes.shape[1] // bits
    c = (planes.reshape(N, per_row, bits).astype(np.int64) << np.arange(bits)).sum(-1)
    return c[:, :K]


def _values(dtype: str, codes: np.ndarray) -> np.ndarray:
    if dtype.startswith("int"):
        return codes - (1 << (BITS[dtype] - 1))              # offset binary
    if dtype == "nf4":
        return np.asarray(NF4_LEVELS)[codes]
    if dtype == "fp8_e4m3":
        return codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)   # fp4, mxfp4 elements


def numpy_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Decode the one quantised node's stored weight independently of powerfusion, then matmul."""
    [node] = [n for n in model.graph.node if n.op_type in ("MatMulNBits", "MatMulLowBit")]
    at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    c = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    K, N, bs = at["K"], at["N"], at["block_size"]
    dtype = at.get("weight_dtype", b"int%d" % at.get("bits", 4)).decode()
    dtype = {"fp4_e2m1": "fp4"}.get(dtype, dtype)
    vals = _values(dtype, _codes(c[node.input[1]], BITS[dtype], N, K)).astype(np.float64)
    s = c[node.input[2]].reshape(N, -1)
    s = 2.0 ** (s.astype(np.float64) - 127) if s.dtype == np.uint8 else s.astype(np.float64)
    w = vals * np.repeat(s, bs, axis=1)[:, :K]
    a = x.astype(np.float64)
    if at.get("act_dtype", b"") == b"int8":
        sa = np.abs(a).max(-1, keepdims=True) / 127
        a = np.clip(np.rint(a / sa), -127, 127) * sa
    return a @ w.T


CASES = [("int4", ()), ("int2", ()), ("int1", ()), ("nf4", ()), ("fp4", ()), ("mxfp4", ()), ("fp8_e4m3", ()),
         ("int4", ("--act", "int8")), ("int2", ("--act", "int8")), ("int1", ("--act", "int8")),
         ("nf4", ("--group", "32"))]


@pytest.mark.parametrize("dtype,extra", CASES)
def test_each_dtype_cpu_session_matches_numpy(tmp_path, dtype, extra):
    model, w = _single()
    q = _quantize(tmp_path, model, "--dtype", dtype, *extra)
    onnx.checker.check_model(q)
    [node] = q.graph.node
    nbits = dtype in ("int4", "int2") and not extra[:1] == ("--act",)
    assert (node.op_type, node.domain) == (("MatMulNBits", "com.microsoft") if nbits else
                                           ("MatMulLowBit", "ai.powerfusion"))
    assert "w" not in {t.name for t in q.graph.initializer}      # the float weight is gone
    x = feed(q)
    y = pf.InferenceSession(q, target="cpu").run(None, x)[0]
    ref = numpy_reference(q, x["x"])
    assert y.dtype == np.float32 and rel_err(y, ref) <= 1e-5
    assert rel_err(ref, x["x"].astype(np.float64) @ w) <= QUANT_ERR[dtype]
    if nbits:   # onnxruntime's contrib op runs the same file
        assert rel_err(ort_run(q, x), ref) <= 1e-4


@pytest.mark.parametrize("dtype", ["nf4", "mxfp4", "int4"])
def test_fp16_mlp_cpu_session(tmp_path, dtype):
    """Two MatMuls (K = 64 below the group: one padded block), fp16; mxfp4's uint8 scales."""
    m = mlp_model(TensorProto.FLOAT16)
    q = _quantize(tmp_path, m, "--dtype", dtype, "--group", "32" if dtype == "mxfp4" else "128")
    assert sum(n.op_type in ("MatMulLowBit", "MatMulNBits") for n in q.graph.node) == 2
    x = feed(q)
    y = pf.InferenceSession(q, target="cpu").run(None, x)[0]
    assert y.dtype == np.float16
    from powerfusion.frontend import run_basic_graph
    sess = pf.InferenceSession(q, target="cpu")
    np.testing.assert_array_equal(run_basic_graph(sess.graph, x)["y"], y)
    assert rel_err(y, ort_run(m, x)) <= 0.35     # against the float model: quantisation error only


def test_onnxruntime_agrees_for_int4_groups(tmp_path):
    model, _ = _single(K=256, N=48)
    q = _quantize(tmp_path, model, "--dtype", "int4", "--group", "64")
    x = feed(q)
    ref = numpy_reference(q, x["x"])
    assert rel_err(ort_run(q, x), ref) <= 1e-4
    assert rel_err(pf.InferenceSession(q, target="cpu").run(None, x)[0], ref) <= 1e-5


@pytest.mark.parametrize("flags,needle", [
    (("--dtype", "int4", "--group", "100"), "--group must be a power of two"),
    (("--dtype", "nf4", "--group", "16"), "--group must be a power of two"),
    (("--dtype", "mxfp4", "--group", "64"), "fixed block of 32"),
    (("--dtype", "nf4", "--act", "int8"), "--act int8"),
    (("--dtype", "fp8_e4m3", "--act", "int8"), "fp8_e4m3"),
])
def test_bad_flags_name_the_flag(tmp_path, capsys, flags, needle):
    model, _ = _single()
    onnx.save(model, tmp_path / "in.onnx")
    assert cli_main(["quantize-weights", str(tmp_path / "in.onnx"), *flags, "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o.onnx").exists()


def test_unknown_dtype_and_no_matmul(tmp_path, capsys):
    model, _ = _single()
    onnx.save(model, tmp_path / "in.onnx")
    with pytest.raises(SystemExit) as e:
        cli_main(["quantize-weights", str(tmp_path / "in.onnx"), "--dtype", "int3", "-o", str(tmp_path / "o.onnx")])
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(g), tmp_path / "relu.onnx")
    assert cli_main(["quantize-weights", str(tmp_path / "relu.onnx"), "--dtype", "nf4", "-o",
                     str(tmp_path / "o.onnx")]) == 2
    assert "nothing to quantise" in capsys.readouterr().err


@pytest.mark.parametrize("break_it,needle", [
    (lambda n, c: c.__setitem__(n.input[1], c[n.input[1]][:-1]), "input 1"),
    (lambda n, c: c.__setitem__(n.input[2], c[n.input[2]].astype(np.float32)), "input 2"),
    (lambda n, c: n.attribute.append(helper.make_attribute("weight_dtype", "int3")), "int3"),
])
def test_malformed_matmul_lowbit_is_refused(tmp_path, break_it, needle):
    model, _ = _single()
    q = _quantize(tmp_path, model, "--dtype", "mxfp4")
    [node] = q.graph.node
    consts = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    if needle == "int3":
        [a] = [a for a in node.attribute if a.name == "weight_dtype"]
        node.attribute.remove(a)
    break_it(node, consts)
    del q.graph.initializer[:]
    q.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    with pytest.raises(UnsupportedOpError, match=needle):
        pf.InferenceSession(q, target="cpu")


@pytest.mark.parametrize("dtype,extra", CASES)
def test_typed_gemm_built_from_the_node_matches(tmp_path, dtype, extra):
    """The (kernel, packed weight) the CUDA session builds for the node computes the same product
    on the host (Matmul.reference unpacks the device layout): fp16 activations, 5e-3; int8 ones 1e-2."""
    from powerfusion.ttile.onnx_lowbit import matmul_lowbit_to_typed
    from powerfusion.ttile.onnx_quant import matmul_nbits_to_typed
    model, _ = _single()
    q = _quantize(tmp_path, model, "--dtype", dtype, *extra)
    [node] = q.graph.node
    consts = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    build = matmul_nbits_to_typed if node.op_type == "MatMulNBits" else matmul_lowbit_to_typed
    mm, packed = build(node, consts, 5, "fp16", "fp32")
    x = feed(q)["x"]
    got = mm.reference(x.astype(np.float16), packed)
    assert rel_err(got, numpy_reference(q, x.astype(np.float16))) <= (1e-2 if extra[:1] == ("--act",) else 5e-3)


@pytest.mark.parametrize("dtype", ["nf4", "mxfp4"])
def test_bf16_model_keeps_its_output_type(tmp_path, dtype):
    """bfloat16 models store float32 scales (mxfp4: uint8): the output is still bfloat16."""
    from .onnx_models import to_bf16
    q = _quantize(tmp_path, to_bf16(mlp_model()), "--dtype", dtype, "--group", "32")
    x = feed(q)
    y = pf.InferenceSession(q, target="cpu").run(None, x)[0]
    assert y.dtype == ml_dtypes.bfloat16
    ref = pf.InferenceSession(to_bf16(mlp_model()), target="cpu").run(None, x)[0]
    assert rel_err(y, ref) <= 0.35     # quantisation error only
