"""Ops that ONNX defines as a function of other ops, expanded into that function's body.

ONNX gives many ops a function body in their schema (RMSNormalization, Attention,
GroupNormalization, the losses, Celu, ...), some of them context-dependent (built for the
node's attributes and input types). Where we have no converter of our own for such an
op, its body -- the definition the standard itself gives -- is inlined at import, with
`onnx.inliner`, and the ops of the body are converted instead. An op we do convert keeps
our converter (a LayerNormalization stays one op, not its body's twenty).
"""
from __future__ import annotations

import onnx
import onnx.inliner
from onnx import defs

from powerfusion.frontend.loader import infer_shapes
from powerfusion.frontend.onnx_graph import DEFAULT_DOMAINS, EXPANDED_FROM, default_opset, node_origin

EXPAND_DOMAIN = "powerfusion.expand"
MAX_DEPTH = 4   # a body may use ops that are functions themselves


def expand_functions(model: onnx.ModelProto, converted: set[str]) -> onnx.ModelProto:
    """`model` with every node of an op type outside `converted` that has a schema function
    replaced by the function's body; shapes are inferred again when anything changed."""
    for _ in range(MAX_DEPTH):
        expanded = _expand_once(model, converted)
        if expanded is None:
            return model
        model = infer_shapes(expanded)
    return model


def _expand_once(model: onnx.ModelProto, converted: set[str]) -> onnx.ModelProto | None:
    opset = default_opset(model)
    types = _value_types(model)
    functions = []
    for index, node in enumerate(model.graph.node):
        if node.domain not in DEFAULT_DOMAINS or node.op_type in converted:
            continue
        body = function_body(node, opset, types)
        if body is None or not _convertible(body, opset, converted):
            continue
        origin = node_origin(node) or f"{node.op_type}/{node.name or node.op_type + '_' + str(index)}"
        for inner in body.node:
            _set_origin(inner, origin)
        body.domain, body.name = EXPAND_DOMAIN, f"{node.op_type}_{index}"
        _add_default_attributes(node, opset)
        node.domain, node.op_type = EXPAND_DOMAIN, body.name
        functions.append(body)
    if not functions:
        return None
    model.functions.extend(functions)
    model.opset_import.append(onnx.helper.make_opsetid(EXPAND_DOMAIN, 1))
    try:
        inlined = onnx.inliner.inline_local_functions(model, convert_version=True)
    except Exception:
        return None   # the nodes stay as they are and are reported unsupported
    del inlined.opset_import[:]
    inlined.opset_import.extend(o for o in model.opset_import if o.domain != EXPAND_DOMAIN)
    return inlined


def function_body(node: onnx.NodeProto, opset: int, types: dict) -> onnx.FunctionProto | None:
    """The schema's function for `node` at `opset` (the newest defined at or below it), or None."""
    try:
        schema = defs.get_schema(node.op_type, opset, node.domain)
    except Exception:
        return None
    plain = [v for v in schema.function_opset_versions if v <= opset]
    context = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    body = onnx.FunctionProto()
    try:
        if context and (not plain or max(context) >= max(plain)):
            inputs = [types[i].SerializeToString() if i in types else onnx.TypeProto().SerializeToString()
                      for i in node.input]
            body.ParseFromString(schema.get_context_dependent_function_with_opset_version(
                max(context), node.SerializeToString(), inputs))
        elif plain:
            body.ParseFromString(schema.get_function_with_opset_version(max(plain)))
        else:
            return None
    except Exception:
        return None
    return body if body.node else None


def _convertible(body: onnx.FunctionProto, opset: int, converted: set[str]) -> bool:
    """Every op of the body is converted or is a function itself (checked again when expanded)."""
    def ok(n):
        if n.domain not in DEFAULT_DOMAINS:
            return False
        if n.op_type in converted:
            return True
        try:
            s = defs.get_schema(n.op_type, opset, n.domain)
        except Exception:
            return False
        return bool(s.function_opset_versions or s.context_dependent_function_opset_versions)
    return all(ok(n) for n in body.node)


def _set_origin(node: onnx.NodeProto, origin: str) -> None:
    if node_origin(node) is None:
        node.metadata_props.add(key=EXPANDED_FROM, value=origin)


def _add_default_attributes(node: onnx.NodeProto, opset: int) -> None:
    """The inliner leaves a body's reference to an attribute the node omits unresolved."""
    schema = defs.get_schema(node.op_type, opset, node.domain)
    present = {a.name for a in node.attribute}
    for name, attr in schema.attributes.items():
        if name not in present and attr.default_value.type:
            node.attribute.append(attr.default_value)


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    g = model.graph
    types = {vi.name: vi.type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    for t in g.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types
