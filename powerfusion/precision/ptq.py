"""INT8 post-training quantisation of an fp32 ONNX model into a standard QDQ model.

Calibration and QDQ placement come from onnxruntime's quantiser (`onnxruntime.quantization`),
a well-kept library made for exactly this (min/max, percentile and entropy calibration; QDQ
placement that its own and other runtimes fuse into integer kernels); we add what it lacks:
checked calibration data (calibration.py), cross-layer equalisation first (equalize.py), and
an accuracy report against the fp32 model. PowerFusion imports the result like any QDQ model
(qdq.py). onnxruntime is needed at quantisation time only (`pip install onnxruntime`).

- static (default): activation scales from the calibration data, stored in the model;
  `method` minmax | percentile | entropy; activations int8 with a zero point (asymmetric) or
  without (`symmetric=True`, range [-127, 127]); weights int8 symmetric, per tensor or per
  output channel (`per_channel=True`).
- dynamic (`dynamic=True`): weights quantised offline, activation scales computed at run time
  (DynamicQuantizeLinear + MatMulInteger / ConvInteger); no calibration data needed.
- `ops="weight-gemms"` (static): only the inputs of MatMul / Gemm / Conv with a constant weight
  get Q/DQ pairs, the ops that become integer GEMMs here (integer_gemm.py); their outputs stay
  float (the int32 accumulator dequantised once, not rounded to int8 again). Every other quantised op
  (onnxruntime's default, `ops="all"`) runs here as float arithmetic between a DequantizeLinear
  and a QuantizeLinear: rounding that costs time and accuracy and saves nothing. That includes
  attention's activation x activation MatMuls, whose Q/DQ pairs also hide the attention pattern
  from the fused attention (frontend/attention.py).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np
import onnx

from powerfusion.errors import PowerFusionError
from powerfusion.precision.calibration import CalibrationData

METHODS = ("minmax", "percentile", "entropy")
OPS = ("all", "weight-gemms")
GEMMS = ("MatMul", "Gemm", "Conv")


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "minmax"
    per_channel: bool = False
    symmetric: bool = False
    dynamic: bool = False
    equalize: bool = False
    ops: str = "all"          # which ops get Q/DQ pairs (static): OPS


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float          # max |q - fp32|
    rel: float              # max |q - fp32| / max |fp32|
    top1_agreement: float | None   # for [N, classes] outputs: argmax agreement


def _ort_quantization():
    try:
        from onnxruntime import quantization
    except ImportError:
        raise PowerFusionError("quantize needs onnxruntime's quantiser: pip install onnxruntime") from None
    return quantization


def quantize_model(model: onnx.ModelProto, calibration: CalibrationData | None,
                   options: QuantizeOptions = QuantizeOptions()) -> onnx.ModelProto:
    """`model` (fp32) -> QDQ (static) or DynamicQuantizeLinear (dynamic) int8 model."""
    q = _ort_quantization()
    if options.method not in METHODS:
        raise PowerFusionError(f"unknown calibration method {options.method!r}; choose {', '.join(METHODS)}")
    if options.ops not in OPS:
        raise PowerFusionError(f"unknown ops selection {options.ops!r}; choose {', '.join(OPS)}")
    if not options.dynamic and (calibration is None or calibration.count == 0):
        raise PowerFusionError("static quantisation needs calibration data (or use dynamic quantisation)")
    if options.equalize:
        from powerfusion.precision.equalize import equalize
        model, _ = equalize(model)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "int8.onnx")
        if options.ops != "all" and not options.dynamic:
            model = _copy(model)
            selection = _selection(model, options.ops)     # names unnamed GEMMs of the copy
        else:
            selection = {}
        onnx.save(model, src)
        if options.dynamic:
            q.quantize_dynamic(src, dst, per_channel=options.per_channel, weight_type=q.QuantType.QInt8)
        else:
            method = {"minmax": q.CalibrationMethod.MinMax, "percentile": q.CalibrationMethod.Percentile,
                      "entropy": q.CalibrationMethod.Entropy}[options.method]
            q.quantize_static(src, dst, _Reader(calibration), quant_format=q.QuantFormat.QDQ,
                              per_channel=options.per_channel, activation_type=q.QuantType.QInt8,
                              weight_type=q.QuantType.QInt8, calibrate_method=method,
                              extra_options={"ActivationSymmetric": options.symmetric, "WeightSymmetric": True,
                                             **selection.pop("extra", {})},
                              **selection)
        return onnx.load(dst)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _selection(model: onnx.ModelProto, ops: str) -> dict:
    """quantize_static's op selection for `ops`: {} for all, else GEMMs whose weight (input 1) is
    an initializer or a Constant node's output, the other GEMMs excluded by name."""
    if ops == "all":
        return {}
    g = model.graph
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    gemms = [n for n in g.node if n.op_type in GEMMS and n.domain in ("", "ai.onnx")]
    from powerfusion.names import fresh_name
    taken = {n.name for n in g.node}
    for n in gemms:       # onnxruntime excludes by node name: name the unnamed ones
        n.name = n.name or fresh_name("pf_gemm", taken)
    return {"op_types_to_quantize": list(GEMMS),
            "nodes_to_exclude": [n.name for n in gemms if len(n.input) < 2 or n.input[1] not in consts],
            # the GEMM's int32 result is dequantised in float here; a Q/DQ pair on it would
            # only round it once more (onnxruntime forms QLinearMatMul from it; we need not)
            "extra": {"OpTypesToExcludeOutputQuantization": list(GEMMS)}}


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over validated samples."""

    def __init__(self, data: CalibrationData):
        self.data, self.i = data, 0

    def get_next(self):
        if self.i >= self.data.count:
            return None
        self.i += 1
        return self.data.sample(self.i - 1)

    def rewind(self):
        self.i = 0


def output_errors(reference: list[np.ndarray], quantized: list[np.ndarray], names: list[str]) -> list[OutputError]:
    errs = []
    for name, r, qv in zip(names, reference, quantized):
        r, qv = np.asarray(r, np.float64), np.asarray(qv, np.float64)
        diff = float(np.abs(r - qv).max()) if r.size else 0.0
        scale = float(np.abs(r).max()) if r.size else 0.0
        top1 = float((r.argmax(-1) == qv.argmax(-1)).mean()) if r.ndim == 2 and r.shape[1] > 1 else None
        errs.append(OutputError(name, diff, diff / scale if scale else diff, top1))
    return errs
