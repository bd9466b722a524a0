"""Precision rewrites on ONNX models: automatic mixed precision (fp16 / bf16) and INT8.

- `convert_precision(model, "fp16" | "bf16" | AmpConfig)`: AMP as a graph rewrite (amp.py).
- `lower_quantized(model)`: QDQ and QLinear / *Integer ops -> standard ops (qdq.py); the
  frontend calls it on every model it imports.
- `quantize_model(model, calibration, ...)`: INT8 post-training quantisation to a QDQ model
  (ptq.py), with weight equalisation (equalize.py) and calibration data checks (calibration.py).
"""
from __future__ import annotations

from powerfusion.precision.amp import AmpConfig, AmpReport, convert_precision, precision_dtype


def lower_quantized(proto, where: str = "the model"):
    """Lower quantised ops (qdq.py) and infer the shapes of what the lowering made."""
    from powerfusion.frontend.loader import infer_shapes
    from powerfusion.precision.qdq import has_quantized_ops, lower_quantized_ops
    if not has_quantized_ops(proto):
        return proto
    return infer_shapes(lower_quantized_ops(proto), where)


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
        from powerfusion.perfmodel.specs import get_target
        if get_target(target).backend != "cpu":
            config = AmpConfig(dtype=dtype, cost_target=target)
    return convert_precision(proto, config)


__all__ = ["AmpConfig", "AmpReport", "convert_precision", "precision_dtype", "lower_quantized", "apply_precision"]
