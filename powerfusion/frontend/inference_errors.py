"""What onnx's strict shape inference says when it fails, made to name the node and its shapes.

onnx reports `(op_type:Relu, node name: )` for an unnamed node -- most exporters leave nodes
unnamed -- and never the shapes it saw. Here the failing inference runs again on a copy whose
unnamed nodes carry the names the converters use (`<op_type>_<index>`, builder.Origin), and
the message gains the node's opset, its inputs and its declared outputs with their types and
shapes as far as the (non-strict) inference knows them.
"""
from __future__ import annotations

import re

import onnx
from onnx import shape_inference

_WHERE = re.compile(r"\(op_type:([\w.]+), node name: ([^)]*)\):?\s*")


def named_nodes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `proto` whose unnamed top-level nodes are named `<op_type>_<index>`."""
    named = onnx.ModelProto()
    named.CopyFrom(proto)
    for index, node in enumerate(named.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"
    return named


def describe_failure(proto: onnx.ModelProto, error: Exception, opset: int) -> str:
    """The strict inference's first error, naming the node (name, op type, opset) and its
    inputs' and declared outputs' types and shapes."""
    named = named_nodes(proto)
    try:
        shape_inference.infer_shapes(named, check_type=True, strict_mode=True, data_prop=True)
        text = str(error)
    except Exception as again:   # the same failure, now with the node's name
        text = str(again)
    text = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    m = _WHERE.search(text)
    node = next((n for n in named.graph.node if m and n.name == m[2]), None)
    if node is None:
        return text
    detail = text[m.end():].strip() or text
    detail = re.sub(r"^\[\w+\]\s*", "", detail)
    known = _known_types(named)
    ins = ", ".join(f"'{t}' {known.get(t, 'unknown')}" for t in node.input if t)
    outs = ", ".join(f"'{t}' {known.get(t, 'unknown')}" for t in node.output if t)
    return f"node '{node.name}' ({node.op_type}, opset {opset}): {detail}; inputs {ins or 'none'}; outputs {outs}"


def _known_types(proto: onnx.ModelProto) -> dict[str, str]:
    """Tensor name -> 'float32 [2, 3]' for what the model declares and lenient inference adds."""
    try:
        inferred = shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:
        inferred = proto
    g = inferred.graph
    out = {t.name: _fmt(t.data_type, list(t.dims)) for t in g.initializer}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type"):
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
                if tt.HasField("shape") else None
            out.setdefault(vi.name, _fmt(tt.elem_type, dims))
    return out


def _fmt(elem_type: int, dims) -> str:
    try:
        name = onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    except Exception:
        name = onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type in onnx.TensorProto.DataType.values() \
            else f"type {elem_type}"
    return f"{name} {list(dims) if dims is not None else '(unknown rank)'}"
