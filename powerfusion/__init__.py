"""PowerFusion: ONNX in; compute-bound ops to vendor libraries, memory-bound subgraphs
fused through an instruction-level graph IR and emitted as CUDA, HIP or BANG C.

    import powerfusion as pf
    sess = pf.InferenceSession("model.onnx")          # onnxruntime's constructor and API
    outputs = sess.run(None, {"x": x})
    q = pf.quantize_weights(model, "int4", 128)       # MatMul weights -> com.microsoft.MatMulNBits

    with pf.options.context(verbose=1):
        ...
"""
from __future__ import annotations

from powerfusion import options
from powerfusion.errors import (CompileError, FeedError, ModelError, NodeError, PowerFusionError,
                                UnsupportedOpError)

__version__ = "0.1.0"

__all__ = ["InferenceSession", "NodeArg", "options", "PowerFusionError", "ModelError",
           "UnsupportedOpError", "NodeError", "FeedError", "CompileError", "quantize_weights",
           "demo_model", "SessionOptions", "RunOptions", "GraphOptimizationLevel", "ExecutionMode", "ModelMetadata",
           "get_available_providers", "get_all_providers", "get_device", "OrtValue", "IOBinding",
           "__version__"]

# onnxruntime's names (`import powerfusion as ort` in an onnxruntime script): module -> names
_ORT_NAMES = {"powerfusion.ort_api": ("SessionOptions", "RunOptions", "GraphOptimizationLevel",
                                      "ExecutionMode", "ModelMetadata", "get_available_providers", "get_all_providers",
                                      "get_device"),
              "powerfusion.iobinding": ("OrtValue", "IOBinding")}


def __getattr__(name):
    # The session pulls in the frontend; `import powerfusion` (and `powerfusion --help`) stays light.
    if name in ("InferenceSession", "NodeArg"):
        from powerfusion import session
        return getattr(session, name)
    for module, names in _ORT_NAMES.items():
        if name in names:
            import importlib
            return getattr(importlib.import_module(module), name)
    if name == "demo_model":
        from powerfusion.demo import demo_model
        return demo_model
    if name == "quantize_weights":  # ttile (jinja2 templates, the scheduler) only when asked for
        from powerfusion.ttile.onnx_quant import quantize_weights
        return quantize_weights
    raise AttributeError(f"module 'powerfusion' has no attribute {name!r}")
