"""Static PTQ with ops="weight-gemms" (ptq.py): Q/DQ pairs only on the inputs of GEMMs with a
constant weight, none on GEMM outputs or activation x activation MatMuls; the model still runs
in onnxruntime, ours (CPU) matches it, and the digit CNN keeps its top-1."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion.errors import PowerFusionError
from powerfusion.precision.calibration import check_calibration
from powerfusion.precision.ptq import QuantizeOptions, quantize_model
from powerfusion.session import InferenceSession

from tests.precision.helpers import digits, digits_data, ort_run, rel_error

pytest.importorskip("onnxruntime.quantization")


def _attention_like(seed: int = 0) -> onnx.ModelProto:
    """x[8, 16] -> q = x Wq + b, k = x Wk (unnamed node) -> softmax(q k^T) q Wo."""
    rng = np.random.default_rng(seed)
    w = lambda name, shape: numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
    inits = [w("wq", (16, 16)), w("wk", (16, 16)), w("wo", (16, 12)), w("bq", (16,))]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q0"], name="q"),
             helper.make_node("Add", ["q0", "bq"], ["q"], name="qb"),
             helper.make_node("MatMul", ["x", "wk"], ["k"]),           # no name: ptq names it
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[1, 0]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
             helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "q"], ["c"], name="context"),
             helper.make_node("MatMul", ["c", "wo"], ["y"], name="o")]
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 12])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _calibration(model, rng, n=16):
    return check_calibration({"x": rng.standard_normal((n, 8, 16)).astype(np.float32)}, model)


def test_only_weight_gemm_inputs_are_quantized():
    m = _attention_like()
    q = quantize_model(m, _calibration(m, np.random.default_rng(1)), QuantizeOptions(per_channel=True, ops="weight-gemms"))
    quantized = {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    # the inputs of q, k (both read x) and o; not the GEMM outputs q0, k, s, y
    assert quantized == {"x", "c"}, quantized
    dq_out = {n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"}
    by_name = {n.name: n for n in q.graph.node if n.op_type == "MatMul"}
    for name in ("scores", "context"):                # activation x activation: left float
        assert not set(by_name[name].input) & dq_out, by_name[name]
    assert set(by_name["o"].input) <= dq_out
    assert all(n.name for n in q.graph.node if n.op_type == "MatMul")
    # the input model is unchanged (ptq names the unnamed GEMM on a copy)
    assert [n.name for n in m.graph.node if n.op_type == "MatMul"].count("") == 1


def test_weight_gemms_model_matches_onnxruntime():
    """Ours on the CPU (integer GEMMs, float elsewhere) against onnxruntime on the same QDQ model:
    both compute the same int8 products exactly, so the float parts differ by rounding only
    (relative error < 1e-4 of the output's range)."""
    m = _attention_like()
    rng = np.random.default_rng(2)
    q = quantize_model(m, _calibration(m, rng), QuantizeOptions(per_channel=True, ops="weight-gemms"))
    x = rng.standard_normal((8, 16)).astype(np.float32)
    ours = InferenceSession(q).run(None, {"x": x})[0]
    assert rel_error(ours, ort_run(q, {"x": x}, optimize=False)[0]) < 1e-4


def test_weight_gemms_digit_cnn_keeps_top1():
    m = digits("digits_cnn")
    d = digits_data()
    q = quantize_model(m, check_calibration({"image": d["x_calib"][:60]}, m),
                       QuantizeOptions(per_channel=True, ops="weight-gemms"))
    x = d["x_test"][:100]
    agree = np.mean(ort_run(q, {"image": x})[0].argmax(1) == ort_run(m, {"image": x})[0].argmax(1))
    assert agree >= 0.97


def test_unknown_ops_selection_is_an_error():
    m = _attention_like()
    with pytest.raises(PowerFusionError, match="unknown ops selection 'gemm'"):
        quantize_model(m, _calibration(m, np.random.default_rng(0)), QuantizeOptions(ops="gemm"))


def test_amp_continues_in_16_bits_after_an_int8_gemm():
    """AMP on the quantised model (amp.py): each integer GEMM's dequantised result is rounded to
    fp16 right after its fp32 scale, so the bias Add after it runs in fp16 (the model still runs
    in onnxruntime). Ours on the CPU and onnxruntime on the converted model, and both against the
    unconverted QDQ model: fp16 rounding of O(1) values, relative error < 2e-2 of the range."""
    from onnx import TensorProto

    from powerfusion.precision.amp import convert_precision
    m = _attention_like()
    rng = np.random.default_rng(4)
    q = quantize_model(m, _calibration(m, rng), QuantizeOptions(per_channel=True, ops="weight-gemms"))
    h = convert_precision(q, "fp16")
    producers = {o: n for n in h.graph.node for o in n.output}
    add = next(n for n in h.graph.node if n.op_type == "Add")
    casts = [producers.get(i) for i in add.input]
    assert any(c is not None and c.op_type == "Cast" and c.attribute[0].i == TensorProto.FLOAT16
               and producers[c.input[0]].op_type == "Mul" for c in casts), [c and c.op_type for c in casts]
    x = rng.standard_normal((8, 16)).astype(np.float32)
    want = ort_run(q, {"x": x}, optimize=False)[0]
    assert rel_error(ort_run(h, {"x": x}, optimize=False)[0], want) < 2e-2
    ours = InferenceSession(q, options={"precision": "fp16"}).run(None, {"x": x})[0]
    assert rel_error(ours, want) < 2e-2


def test_cli_quantize_ops_weight_gemms(tmp_path, capsys):
    from powerfusion.cli import main as cli_main

    from tests.precision.helpers import DIGITS
    cal = tmp_path / "cal.npz"
    np.savez(cal, image=digits_data()["x_calib"][:20])
    out = tmp_path / "q.onnx"
    assert cli_main(["quantize", f"{DIGITS}/digits_cnn.onnx", "--calibration", str(cal), "--per-channel",
                     "--ops", "weight-gemms", "-o", str(out)]) == 0
    q = onnx.load(out)
    gemm_inputs = {i for n in q.graph.node if n.op_type in ("MatMul", "Gemm", "Conv") for i in n.input}
    dq = {n.output[0]: n.input[0] for n in q.graph.node if n.op_type == "DequantizeLinear"}
    # every QuantizeLinear feeds (through its DequantizeLinear) a GEMM
    for n in q.graph.node:
        if n.op_type == "QuantizeLinear":
            assert any(src == n.output[0] and name in gemm_inputs for name, src in dq.items()), n.name
    assert "top-1 agreement" in capsys.readouterr().out
