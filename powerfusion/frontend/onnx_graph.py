"""What the import steps read off an ONNX model: its default-domain opset, its initializers as
numpy arrays, and which of the model's nodes a node of an expanded function body stands for
(expand.py writes that mark, the converters' error messages read it)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")
# metadata key on every node of an inlined body: "op type/node name" of the node it replaced,
# so that an unsupported node of a body is reported as the op the model used
EXPANDED_FROM = "powerfusion.expanded_from"


def default_opset(proto: onnx.ModelProto) -> int:
    for imp in proto.opset_import:
        if imp.domain in DEFAULT_DOMAINS:
            return imp.version
    return 1


def initializer_arrays(model: onnx.ModelProto, cache: dict) -> dict[str, np.ndarray]:
    for t in model.graph.initializer:
        if t.name not in cache:
            cache[t.name] = numpy_helper.to_array(t)
    return {t.name: cache[t.name] for t in model.graph.initializer}


def node_origin(node: onnx.NodeProto) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == EXPANDED_FROM), None)


def expanded_from(node: onnx.NodeProto) -> tuple[str, str] | None:
    """(op type, node name) of the model's node whose function body `node` came from."""
    origin = node_origin(node)
    return tuple(origin.split("/", 1)) if origin else None
