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


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "minmax"
    per_channel: bool = False
    symmetric: bool = False
    dynamic: bool = False
    equalize: bool = False


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
    if not options.dynamic and (calibration is None or calibration.count == 0):
        raise PowerFusionError("static quantisation needs calibration data (or use dynamic quantisation)")
    if options.equalize:
        from powerfusion.precision.equalize import equalize
        model, _ = equalize(model)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "int8.onnx")
        onnx.save(model, src)
        if options.dynamic:
            q.quantize_dynamic(src, dst, per_channel=options.per_channel, weight_type=q.QuantType.QInt8)
        else:
            method = {"minmax": q.CalibrationMethod.MinMax, "percentile": q.CalibrationMethod.Percentile,
                      "entropy": q.CalibrationMethod.Entropy}[options.method]
            q.quantize_static(src, dst, _Reader(calibration), quant_format=q.QuantFormat.QDQ,
                              per_channel=options.per_channel, activation_type=q.QuantType.QInt8,
                              weight_type=q.QuantType.QInt8, calibrate_method=method,
                              extra_options={"ActivationSymmetric": options.symmetric, "WeightSymmetric": True})
        return onnx.load(dst)


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
