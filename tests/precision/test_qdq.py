"""Quantised models written by onnxruntime's own quantiser import and match onnxruntime.

Static QDQ models end in DequantizeLinear, so outputs are multiples of one scale (a "step").
We lower Q/DQ into float arithmetic with the same roundings as onnxruntime's kernels; at a
value within an ulp of a rounding tie the two may pick neighbouring steps, so the tolerance is
one output step, and at least 99 % of the outputs must be identical. Dynamic models end in
float arithmetic: relative 1e-5 of the output's max |value|."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from powerfusion.session import InferenceSession

from .helpers import digits, digits_data, mlp, ort_run, rel_error

pytest.importorskip("onnxruntime.quantization")


class _Reader:
    def __init__(self, xs, name="image"):
        self.xs, self.name, self.i = xs, name, 0

    def get_next(self):
        self.i += 1
        return {self.name: self.xs[self.i - 1:self.i]} if self.i <= len(self.xs) else None

    def rewind(self):
        self.i = 0


def _ort_quantize(model, static: bool, fmt: str = "QDQ", per_channel: bool = False, reader=None,
                  ops=None) -> onnx.ModelProto:
    from onnxruntime import quantization as q
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "a.onnx"), os.path.join(tmp, "b.onnx")
        onnx.save(model, src)
        if static:
            q.quantize_static(src, dst, reader or _Reader(digits_data()["x_calib"][:40]), per_channel=per_channel,
                              quant_format=getattr(q.QuantFormat, fmt), op_types_to_quantize=ops)
        else:
            q.quantize_dynamic(src, dst, per_channel=per_channel)
        return onnx.load(dst)


def _output_step(model) -> float:
    out = model.graph.output[0].name
    dq = next(n for n in model.graph.node if out in n.output)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return float(inits[dq.input[1]]) if dq.op_type == "DequantizeLinear" else float("nan")


@pytest.mark.parametrize("per_channel", [False, True])
def test_static_qdq_cnn_matches_onnxruntime(per_channel):
    q = _ort_quantize(digits("digits_cnn"), True, "QDQ", per_channel)
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in q.graph.node}
    x = digits_data()["x_test"][:48]
    ours = InferenceSession(q, shapes={"image": x.shape}).run(None, {"image": x})[0]
    step = _output_step(q)
    for optimize in (False, True):     # True: onnxruntime fuses Q/DQ into integer kernels
        ref = ort_run(q, {"image": x}, optimize)[0]
        assert np.abs(ours - ref).max() <= step * 1.001, (optimize, np.abs(ours - ref).max(), step)
        assert np.mean(ours == ref) >= 0.99


def test_qlinear_conv_and_matmul_match_onnxruntime():
    """QOperator format: QLinearConv (the CNN's convs only: its Gemms would become com.microsoft.QGemm)
    and QLinearMatMul (an MLP); the graphs end in DequantizeLinear + float ops."""
    q = _ort_quantize(digits("digits_cnn"), True, "QOperator", ops=["Conv"])
    assert "QLinearConv" in {n.op_type for n in q.graph.node}
    x = digits_data()["x_test"][:16]
    ours = InferenceSession(q, shapes={"image": x.shape}).run(None, {"image": x})[0]
    assert rel_error(ours, ort_run(q, {"image": x})[0]) < 1e-3
    xs = np.random.default_rng(2).standard_normal((40, 4, 16)).astype(np.float32)
    q = _ort_quantize(mlp(), True, "QOperator", reader=_Stack(xs), ops=["MatMul"])   # not its QLinearAdd etc.
    assert "QLinearMatMul" in {n.op_type for n in q.graph.node}
    ours = InferenceSession(q).run(None, {"x": xs[0]})[0]
    assert rel_error(ours, ort_run(q, {"x": xs[0]})[0]) < 1e-3


class _Stack(_Reader):
    def __init__(self, xs):
        super().__init__(xs, "x")

    def get_next(self):
        self.i += 1
        return {"x": self.xs[self.i - 1]} if self.i <= len(self.xs) else None


@pytest.mark.parametrize("model_fn", [lambda: mlp(), lambda: digits("digits_cnn")])
def test_dynamic_quantized_matches_onnxruntime(model_fn):
    model = model_fn()
    q = _ort_quantize(model, False)
    ops = {n.op_type for n in q.graph.node}
    assert "DynamicQuantizeLinear" in ops and ops & {"MatMulInteger", "ConvInteger"}
    name = model.graph.input[0].name
    x = digits_data()["x_test"][:1] if name == "image" else \
        np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    ours = InferenceSession(q, shapes={name: x.shape}).run(None, {name: x})[0]
    assert rel_error(ours, ort_run(q, {name: x})[0]) < 1e-5
