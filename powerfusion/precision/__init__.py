"""Precision rewrites on ONNX models: automatic mixed precision (fp16 / bf16) and INT8.

- `convert_precision(model, "fp16" | "bf16" | AmpConfig)`: AMP as a graph rewrite (amp.py).
- `qdq.lower_quantized_ops(model)`: QDQ and QLinear / *Integer ops -> standard ops; the
  frontend calls it on every model it imports.
- `quantize_model(model, calibration, ...)`: INT8 post-training quantisation to a QDQ model
  (ptq.py), with weight equalisation (equalize.py) and calibration data checks (calibration.py).
"""
from __future__ import annotations

from powerfusion.precision.amp import AmpConfig, AmpReport, convert_precision, precision_dtype


def apply_precision(proto, precision, target: str | None = None):
    """`proto` rewritten for a session's `precision` option: "fp32" (unchanged), "fp16", "bf16"
    or an AmpConfig. GPU targets weigh the conversion by their own figures."""
    if isinstance(precision, AmpConfig):
        return convert_precision(proto, precision)
    dtype = precision_dtype(precision)
    if dtype is None:
        return proto
    config = AmpConfig(dtype=dtype)
    if target:
        from powerfusion.targets.specs import get_target
        if get_target(target).backend != "cpu":
            config = AmpConfig(dtype=dtype, cost_target=target)
    return convert_precision(proto, config)


__all__ = ["AmpConfig", "AmpReport", "convert_precision", "precision_dtype", "apply_precision"]
