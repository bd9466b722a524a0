"""The table from ONNX op type to converter, and the whole-graph conversion.

A converter takes a NodeCtx and emits basic ops whose final outputs carry the ONNX
node's output names. CHECKS hold per-op tests of attribute values we do not
compile; every failing node is collected before conversion starts so that one
UnsupportedOpError lists them all.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from powerfusion.errors import UnsupportedOpError
from powerfusion.basic import BasicGraph, TensorInfo
from powerfusion.frontend import (ops_conv_transpose, ops_einsum, ops_elementwise, ops_index, ops_nn, ops_resize,
                                  ops_shape)
from powerfusion.frontend.builder import GraphBuilder, NodeCtx
from powerfusion.frontend.evaluate import evaluate_reference
from powerfusion.frontend.fallback import can_fall_back, convert_fallback
from powerfusion.frontend.fallback import report as report_fallback
from powerfusion.frontend.onnx_graph import DEFAULT_DOMAINS, default_opset, expanded_from, initializer_arrays
from powerfusion.frontend.quantized import check_quantized, convert_quantized, is_quantized

CONVERTERS: dict[str, Callable[[NodeCtx], None]] = {
    **ops_elementwise.CONVERTERS, **ops_shape.CONVERTERS, **ops_nn.CONVERTERS, **ops_index.CONVERTERS,
    **ops_einsum.CONVERTERS, **ops_resize.CONVERTERS, **ops_conv_transpose.CONVERTERS}
CHECKS: dict[str, Callable[[NodeCtx], str | None]] = {**ops_shape.CHECKS, **ops_nn.CHECKS, **ops_index.CHECKS,
                                                      **ops_resize.CHECKS}

# inputs that play the role of attributes: they must be constants (after folding)
REDUCE_AXES = {op: 1 for op in ops_nn.REDUCE}
CONST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Split": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,),
    "Pad": (1, 2, 3), "Clip": (1, 2), "Dropout": (1, 2), "ConstantOfShape": (0,), "Tile": (1,),
    **{op: (i,) for op, i in REDUCE_AXES.items()}, **ops_index.CONST_INPUTS,
    **ops_resize.CONST_INPUTS,
}

SUPPORTED_DTYPES = {np.dtype(t) for t in ("float32", "float16", "float64", "int64", "int32", "int8", "uint8",
                                          "bool")} | {np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
                                              onnx.TensorProto.BFLOAT16))}


def tensor_infos(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    g = model.graph
    infos = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        if all(d.HasField("dim_value") for d in tt.shape.dim) and tt.elem_type:
            dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
            infos[vi.name] = TensorInfo(vi.name, tuple(d.dim_value for d in tt.shape.dim), dt)
    for t in g.initializer:
        infos[t.name] = TensorInfo(t.name, tuple(t.dims), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)))
    return infos


def convert_graph(model: onnx.ModelProto, arrays: dict | None = None, fallback: str | None = None) -> BasicGraph:
    """A folded, shape-inferred ModelProto -> BasicGraph. `arrays`: initializer values already
    converted to numpy, by name. `fallback` ('onnxruntime'): nodes we cannot convert run
    through it as library steps where they can (frontend/fallback.py)."""
    g = model.graph
    opset = default_opset(model)
    consts = initializer_arrays(model, {} if arrays is None else arrays)
    infos = tensor_infos(model)
    names = {n for node in g.node for n in list(node.input) + list(node.output)} | set(infos)
    b = GraphBuilder(names)
    ctxs = [NodeCtx(node, opset, b, consts, infos, i) for i, node in enumerate(g.node)]
    foreign = _check_supported(ctxs, fallback)
    for vi in g.input:
        b.tensors[vi.name] = infos[vi.name]
    for cx in ctxs:
        if id(cx) in foreign:
            convert_fallback(cx)
            continue
        (convert_quantized if is_quantized(cx.node) else CONVERTERS[cx.op_type])(cx)
    report_fallback([(cx.origin.node, cx.op_type) for cx in ctxs if id(cx) in foreign])
    outputs = []
    for vi in g.output:
        if vi.name not in b.tensors and vi.name in consts:  # an output that folded to a constant
            b.constant(consts[vi.name], name=vi.name)
        outputs.append(b.tensors[vi.name])
    _drop_dead_nodes(b, outputs)
    return BasicGraph(name=g.name or "model", inputs=[infos[vi.name] for vi in g.input], outputs=outputs,
                      tensors=b.tensors, constants=b.constants, nodes=b.nodes, opset=opset,
                      metadata={"producer": model.producer_name, "ir_version": model.ir_version})


def raise_unsupported(model: onnx.ModelProto) -> None:
    """UnsupportedOpError listing every node with an op type, domain, attribute or dtype we do
    not take, if any: what stops strict shape inference other than an error in the model.
    `model` may be a skeleton (weights as graph inputs) whose shapes stop where inference
    failed, so constant inputs and static output shapes are not asked for here: every node
    downstream of the failure would be listed, hiding the one that failed."""
    b = GraphBuilder(set())
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    infos = tensor_infos(model)
    ctxs = [NodeCtx(n, default_opset(model), b, consts, infos, i) for i, n in enumerate(model.graph.node)]
    bad = [_unsupported_entry(cx, reason) for cx in ctxs
           if (reason := _unknown_op_reason(cx) or _attribute_reason(cx)
               or (_dynamic_output_reason(cx) if _inputs_shaped(cx) else None))]
    if bad:
        raise UnsupportedOpError(bad)


def _unknown_op_reason(cx: NodeCtx) -> str | None:
    node = cx.node
    if is_quantized(node):  # the one op of another domain we take (com.microsoft.MatMulNBits)
        return None
    if node.domain not in DEFAULT_DOMAINS:
        return (f"domain '{node.domain}' is not supported (only the default ONNX domain is, "
                "and com.microsoft for MatMulNBits)")
    return None if node.op_type in CONVERTERS else "op type not supported"


def _inputs_shaped(cx: NodeCtx) -> bool:
    """Every input has an inferred shape: a node without an output shape is then where
    inference stopped, not downstream of it."""
    return all(cx.inferred(name) is not None for name in cx.node.input if name)


def _attribute_reason(cx: NodeCtx) -> str | None:
    if is_quantized(cx.node):
        return None
    return (CHECKS[cx.op_type](cx) if cx.op_type in CHECKS else None) or _dtype_reason(cx)


def _check_supported(ctxs: list[NodeCtx], fallback: str | None = None) -> set[int]:
    """Raises UnsupportedOpError listing every node we cannot convert; with a fallback, the
    ids of the contexts that run through it instead (those it can take)."""
    bad, foreign = [], set()
    for cx in ctxs:
        node = cx.node
        reason = None
        if is_quantized(node):
            reason = check_quantized(cx) or _dynamic_output_reason(cx)
        elif (reason := _unknown_op_reason(cx)) is not None:
            pass
        else:
            reason = (_runtime_input_reason(cx) or (CHECKS[node.op_type](cx) if node.op_type in CHECKS else None)
                      or _dtype_reason(cx) or _dynamic_output_reason(cx))
        if reason and fallback and can_fall_back(cx):
            foreign.add(id(cx))
        elif reason:
            bad.append(_unsupported_entry(cx, reason))
    if bad:
        raise UnsupportedOpError(bad)
    return foreign


def _unsupported_entry(cx: NodeCtx, reason: str) -> tuple[str, str, int, str]:
    """(node, op type, opset, reason); a node of an expanded function body is reported as the
    model's node it came from, naming the body's op that failed."""
    origin = expanded_from(cx.node)
    if origin is None:
        return cx.origin.node, cx.op_type, cx.opset, f"{reason}; input shapes {_shapes(cx)}"
    op_type, name = origin
    return (name, op_type, cx.opset,
            f"its ONNX function body's {cx.op_type} node: {reason}; input shapes {_shapes(cx)}")


def _runtime_input_reason(cx: NodeCtx) -> str | None:
    for i in CONST_INPUTS.get(cx.op_type, ()):
        if cx.has(i) and cx.const(i) is None:
            return f"input {i} ('{cx.node.input[i]}') must be a constant, but it is computed at run time"
    return None


def _dynamic_output_reason(cx: NodeCtx) -> str | None:
    for name in cx.node.output:
        if name and cx.inferred(name) is None:
            return _invalid_inputs_reason(cx) or (
                f"output '{name}' has no static shape: shape inference gives none although every input shape "
                f"is static, so it depends on run-time data or an attribute is invalid ({_attributes(cx)}); "
                "--shapes cannot fix it")
    return None


def _attributes(cx: NodeCtx) -> str:
    """The node's attributes, short (for a message)."""
    import onnx
    parts = []
    for a in cx.node.attribute:
        v = onnx.helper.get_attribute_value(a)
        text = v.decode(errors="replace") if isinstance(v, bytes) else repr(v)
        parts.append(f"{a.name}={text[:40]}")
    return "attributes " + ", ".join(parts) if parts else "no attributes"


_PROBE_ELEMENTS = 1 << 16


def _invalid_inputs_reason(cx: NodeCtx) -> str | None:
    """Where every input is a constant or has a small static shape, run the node once on zeros
    with the ONNX reference: its error names what is wrong (Reshape with two -1, Slice step 0,
    a Split that does not add up), which "no static shape" would hide."""
    feeds, total = {}, 0
    for i, name in enumerate(cx.node.input):
        if not name:
            continue
        value = cx.const(i)
        if value is None and i in CONST_INPUTS.get(cx.op_type, ()):
            return None   # zeros would stand for a shape or axes: the probe would say nothing true
        if value is None:
            info = cx.inferred(name)
            if info is None:
                return None
            total += int(np.prod(info.shape, dtype=np.int64))
            if total > _PROBE_ELEMENTS or np.dtype(info.dtype).kind not in "fiub":
                return None
            value = np.zeros(info.shape, info.dtype)
        feeds[name] = np.asarray(value)
    if cx.op_type == "Split" and len(cx.node.input) > 1 and cx.node.input[1] in feeds:
        data, sizes = feeds[cx.node.input[0]], feeds[cx.node.input[1]]
        axis = int(cx.attr("axis", 0)) % max(data.ndim, 1)
        if data.ndim and int(sizes.sum()) != data.shape[axis]:
            return f"its split sizes {sizes.tolist()} add up to {int(sizes.sum())}, not to axis {axis}'s {data.shape[axis]}"
    try:
        evaluate_reference(cx.node, feeds, cx.opset)
    except Exception as e:   # the reference's own error, whatever its type
        text = str(e).strip().splitlines()
        return f"its inputs are invalid for {cx.op_type}: {text[0] if text else type(e).__name__}"
    return None


# element types only Cast and CastLike take (to and from): float8, int4/uint4, int2/uint2, float4,
# the wider integers; numpy (ml_dtypes) executes them, the C backends do not render them
CAST_ONLY_DTYPES = {np.dtype(onnx.helper.tensor_dtype_to_np_dtype(getattr(onnx.TensorProto, t))) for t in (
    "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "INT4", "UINT4", "INT2", "UINT2",
    "FLOAT4E2M1", "INT16", "UINT16", "UINT32", "UINT64") if hasattr(onnx.TensorProto, t)}
CAST_OPS = ("Cast", "CastLike")


def cpu_only_nodes(graph: BasicGraph) -> list[tuple[str, str, int, str]]:
    """Basic nodes only the CPU executor runs (onnxruntime fallback nodes; tensors of the
    Cast-only element types, which the C backends have no types for), as UnsupportedOpError
    entries naming their ONNX nodes, once per node."""
    from powerfusion.basic import OnnxFallback, TypedMatMul
    out, seen = [], set()
    for n in graph.nodes:
        if isinstance(n.op, TypedMatMul):
            continue   # packed low-bit weights: the typed GEMM kernels take them on every target
        dtypes = {np.dtype(graph.tensors[t].dtype) for t in n.inputs + n.outputs}
        exotic = sorted(d.name for d in dtypes & CAST_ONLY_DTYPES)
        if isinstance(n.op, OnnxFallback):
            why = "runs through the onnxruntime fallback, on the cpu target only"
        elif exotic:
            why = f"element type {', '.join(exotic)} runs on the cpu target only"
        else:
            continue
        if n.origin.node not in seen:
            seen.add(n.origin.node)
            out.append((n.origin.node, n.origin.op_type, n.origin.opset, why))
    return out


def _dtype_reason(cx: NodeCtx) -> str | None:
    allowed = SUPPORTED_DTYPES | CAST_ONLY_DTYPES if cx.op_type in CAST_OPS else SUPPORTED_DTYPES
    for name in list(cx.node.input) + list(cx.node.output):
        info = cx.inferred(name)
        if info is not None and np.dtype(info.dtype) not in allowed:
            return f"tensor '{name}' has unsupported dtype {np.dtype(info.dtype).name}"
    return None


def _shapes(cx: NodeCtx):
    return [cx.inferred(n).shape if cx.inferred(n) else None for n in cx.node.input]


def _drop_dead_nodes(b, outputs) -> None:
    """Basic nodes no output depends on (a Transpose folded into a MatMul's trans flag)."""
    live, keep = {t.name for t in outputs}, []
    for n in reversed(b.nodes):
        if any(o in live for o in n.outputs):
            keep.append(n)
            live.update(n.inputs)
    if len(keep) < len(b.nodes):
        b.nodes[:] = keep[::-1]
