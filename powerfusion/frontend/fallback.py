"""The onnxruntime fallback (option fallback='onnxruntime'): ONNX nodes the frontend cannot
convert become `OnnxFallback` library steps, each run by onnxruntime on the CPU, so that a
model with an unsupported op runs today and a user sees which nodes that costs.

A node qualifies when its outputs have static inferred shapes and it has no subgraph
attribute (If/Loop/Scan bodies read outer-scope tensors); the others stay unsupported and
are reported as usual. onnxruntime is an optional dependency: without it, asking for the
fallback is an error that says so.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx

from powerfusion.errors import PowerFusionError
from powerfusion.basic import OnnxFallback

FALLBACKS = ("onnxruntime",)


class FallbackWarning(UserWarning):
    """Nodes that run through onnxruntime instead of compiled code."""


def check_fallback(name: str | None) -> None:
    if name is None:
        return
    if name not in FALLBACKS:
        raise PowerFusionError(f"unknown fallback '{name}'; known: {', '.join(FALLBACKS)} (or None)")
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise PowerFusionError("fallback='onnxruntime' needs onnxruntime (pip install onnxruntime)") from None


def can_fall_back(cx) -> bool:
    node = cx.node
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    outputs_static = all(cx.inferred(o) is not None for o in node.output if o)
    inputs_known = all(cx.inferred(i) is not None or cx.const(k) is not None
                       for k, i in enumerate(node.input) if i)
    return outputs_static and inputs_known


def convert_fallback(cx) -> None:
    """One OnnxFallback basic node per used output of the ONNX node."""
    slots = tuple(k for k, i in enumerate(cx.node.input) if i)
    inputs = [cx.inp(k) for k in slots]
    data = cx.node.SerializeToString()
    for k, name in enumerate(cx.node.output):
        if name:
            info = cx.inferred(name)
            cx.emit(OnnxFallback(cx.op_type, data, cx.opset, slots, k), inputs, info.shape, info.dtype, out=name)


def report(nodes: list[tuple[str, str]]) -> None:
    """A FallbackWarning naming the nodes that run through onnxruntime, op types counted."""
    if not nodes:
        return
    counts: dict[str, int] = {}
    for _, op in nodes:
        counts[op] = counts.get(op, 0) + 1
    by_type = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    names = ", ".join(f"'{n}'" for n, _ in nodes)
    warnings.warn(f"{len(nodes)} node(s) run through onnxruntime on the CPU (fallback): {by_type}: {names}",
                  FallbackWarning, stacklevel=3)


def run_fallback(op: OnnxFallback, args: list[np.ndarray], dtype) -> np.ndarray:
    session, input_names = _session(op.node, op.opset, op.slots, tuple(np.dtype(a.dtype) for a in args),
                                    tuple(a.shape for a in args))
    outputs = session.run(None, dict(zip(input_names, args)))
    return np.asarray(outputs[op.output])


@functools.lru_cache(maxsize=256)
def _session(data: bytes, opset: int, slots, dtypes, shapes):
    import onnxruntime as ort
    node = onnx.NodeProto()
    node.ParseFromString(data)
    names = [node.input[k] for k in slots]
    inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(d), s)
              for n, d, s in zip(names, dtypes, shapes)]
    outputs = [onnx.helper.make_empty_tensor_value_info(o) if o else onnx.helper.make_empty_tensor_value_info(
        f"unused_{k}") for k, o in enumerate(node.output)]
    for k, o in enumerate(node.output):
        if not o:
            node.output[k] = f"unused_{k}"
    graph = onnx.helper.make_graph([node], "fallback", inputs, outputs)
    imports = [onnx.helper.make_opsetid("", opset)]
    if node.domain not in ("", "ai.onnx"):
        imports.append(onnx.helper.make_opsetid(node.domain, 1))
    model = onnx.helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]), names
