"""Cast elimination on an ONNX graph: `Cast(to=A)(Cast(to=B)(x))` with x of type A and B able
to hold every value of A exactly (fp16 -> fp32 -> fp16) is x itself. The reverse order
(fp32 -> fp16 -> fp32) rounds, so it is never removed. Casts to a tensor's own type are
dropped too. Graph outputs keep their names, so a cast producing one stays.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

# (narrow, wide): every value of `narrow` is exactly representable in `wide`
LOSSLESS = {
    (TensorProto.FLOAT16, TensorProto.FLOAT), (TensorProto.BFLOAT16, TensorProto.FLOAT),
    (TensorProto.FLOAT16, TensorProto.DOUBLE), (TensorProto.BFLOAT16, TensorProto.DOUBLE),
    (TensorProto.FLOAT, TensorProto.DOUBLE),
    (TensorProto.INT8, TensorProto.INT32), (TensorProto.UINT8, TensorProto.INT32),
    (TensorProto.INT8, TensorProto.FLOAT), (TensorProto.UINT8, TensorProto.FLOAT),
    (TensorProto.INT8, TensorProto.FLOAT16), (TensorProto.UINT8, TensorProto.FLOAT16),
}


def _to(node) -> int:
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == "to")


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def eliminate_casts(model: onnx.ModelProto) -> int:
    """Cancel inverse cast pairs and identity casts in place; returns how many casts went."""
    g = model.graph
    types = _elem_types(model)
    producer = {o: n for n in g.node for o in n.output}
    outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}
    for node in g.node:
        if node.op_type != "Cast" or node.output[0] in outputs:
            continue
        src = node.input[0]
        first = producer.get(src)
        if types.get(src) == _to(node):
            rename[node.output[0]] = src                                   # identity cast
        elif first is not None and first.op_type == "Cast":
            x = first.input[0]
            if types.get(x) == _to(node) and (types.get(x), _to(first)) in LOSSLESS:
                rename[node.output[0]] = x                                 # inverse pair
    if not rename:
        return 0
    for node in g.node:
        for i, name in enumerate(node.input):
            while name in rename:
                name = rename[name]
            node.input[i] = name
    removed = remove_unused_casts(model)
    return removed


def remove_unused_casts(model: onnx.ModelProto) -> int:
    """Drop Cast nodes whose output nothing reads (repeatedly); returns how many went."""
    g = model.graph
    removed = 0
    while True:
        read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [k for k, n in enumerate(g.node) if n.op_type == "Cast" and n.output[0] not in read]
        if not dead:
            return removed
        for k in reversed(dead):
            del g.node[k]
        removed += len(dead)
