"""User-facing errors. Every error that a model or a feed can cause is one of these,
and its message names the node, op type, opset and shapes involved."""
from __future__ import annotations


class PowerFusionError(Exception):
    """Base class: the CLI prints these as one paragraph, without a traceback."""


class ModelError(PowerFusionError):
    """The model file is malformed, fails onnx.checker, or has a dynamic dimension."""


class UnsupportedOpError(PowerFusionError):
    """One or more nodes use an op (or an attribute value) we do not compile."""

    def __init__(self, nodes: list[tuple[str, str, int, str]]):
        # nodes: (node name, op type, opset, reason or shapes)
        self.nodes = nodes
        lines = [f"  - node '{n}' ({op}, opset {opset}): {why}" for n, op, opset, why in nodes]
        super().__init__(f"{len(nodes)} unsupported node(s):\n" + "\n".join(lines))


class NodeError(PowerFusionError):
    """A node cannot be converted: bad attribute values or shapes."""

    def __init__(self, node: str, op_type: str, opset: int, shapes, message: str):
        self.node, self.op_type, self.opset, self.shapes = node, op_type, opset, shapes
        super().__init__(f"node '{node}' ({op_type}, opset {opset}, input shapes {shapes}): {message}")


class FeedError(PowerFusionError):
    """An input feed has the wrong name, shape or dtype."""


class CompileError(PowerFusionError):
    """A backend compiler rejected emitted source (a bug in PowerFusion, reported with the source path)."""


class DataError(PowerFusionError):
    """A run's data is outside what an op accepts (an index out of range, an integer division
    by zero), where onnxruntime refuses too: never a silently wrong value."""
