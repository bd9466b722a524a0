"""Integer GEMMs for quantised MatMuls: int8 x int8 -> int32, zero points folded out.

A backend with integer tensor cores (cuBLAS's IMMA path, backends/cuda/int8_gemm.py) multiplies
signed 8-bit operands without zero points. Quantised MatMuls carry them, so the lowering
(qdq.py) rewrites, for a constant int8 weight W [K, N] with zero point 0 (symmetric weights, as
onnxruntime's quantisers write them) and an activation a of zero point z:

    sum_k (a[m,k] - z) W[k,n] = sum_k a8[m,k] W[k,n] + (s - z) * colsum(W)[n]

with a8 = a - s an int8 tensor (s = 128 for uint8 activations, 0 for int8 ones) made by a
tiny elementwise step that the partition fuses into the producing memory-bound kernel, and
colsum(W) computed once here, at import. The product is a standard `MatMulInteger` of two
int8 tensors without zero points (frontend: a MatMul with an int32 result); the correction is
one int32 Add (a constant vector when z is, else (s - z) * colsum at run time), again
memory-bound. Other weights (non-constant, uint8, non-zero zero points) keep the float lowering.
Convolutions (ConvInteger, 2-D, one group) use the same identity per output channel, with the
padding made explicit first (integer_conv).

`fuse_qdq_integer` finds the QDQ form of the same GEMM, MatMul(DequantizeLinear(q_a),
DequantizeLinear(W)) (and Gemm with alpha = beta = 1, and Conv -> ConvInteger), before the weight's DequantizeLinear is
folded into a float constant, and rewrites it into MatMulInteger(q_a, W, z_a) scaled by
a_scale * w_scale (per tensor or per output column), which the lowering then takes as above.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SHIFT = {TensorProto.UINT8: 128, TensorProto.INT8: 0}   # a8 = a - SHIFT[type of a]


def column_sums(w: np.ndarray) -> np.ndarray:
    """colsum(W)[n] = sum_k W[k, n], exactly, as int32 (|sum| <= 128 K)."""
    return np.asarray(w, np.int64).sum(axis=0).astype(np.int32)


def correction(w: np.ndarray, shift: int, zero_point: int) -> np.ndarray:
    """(shift - z) * colsum(W): what the int8 product of the shifted activation lacks."""
    return ((shift - int(zero_point)) * column_sums(w).astype(np.int64)).astype(np.int32)


def int8_weight(lw, name: str, zp: str | None) -> np.ndarray | None:
    """The constant int8 [K, N] weight `name` when its zero point is absent or all zero."""
    w = lw.consts.get(name)
    if w is None or w.dtype != np.int8 or w.ndim != 2:
        return None
    if zp is not None and (zp not in lw.consts or np.any(lw.consts[zp] != 0)):
        return None
    return w


def integer_product(lw, a: str, a_zp: str | None, w_name: str, w: np.ndarray) -> str | None:
    """An int32 tensor equal to sum_k (a - a_zp) * W (ONNX MatMulInteger), through an int8 x int8
    MatMulInteger without zero points; None where `a` is not an 8-bit tensor with a scalar zero point."""
    atype = lw.types.get(a)
    if atype not in SHIFT or a not in lw.ranks or lw.ranks[a] < 2:
        return None
    acc = lw.op("MatMulInteger", [_shifted_int8(lw, a, SHIFT[atype]), w_name])
    return _corrected(lw, acc, SHIFT[atype], a_zp, column_sums(w))


def int8_conv_weight(lw, name: str, zp: str | None) -> np.ndarray | None:
    """The constant int8 [M, C, KH, KW] weight `name` when its zero point is absent or all zero."""
    w = lw.consts.get(name)
    if w is None or w.dtype != np.int8 or w.ndim != 4:
        return None
    if zp is not None and (zp not in lw.consts or np.any(lw.consts[zp] != 0)):
        return None
    return w


def integer_conv(lw, x: str, x_zp: str | None, w_name: str, w: np.ndarray, attrs: dict) -> str | None:
    """An int32 tensor equal to ONNX ConvInteger(x, W, x_zp) (2-D, one group), through an int8
    x int8 ConvInteger without zero points. The padding must contribute x_zp - x_zp = 0, not
    (0 - s) * W, so x is padded with its zero point first (a Pad, memory-bound) and the
    convolution has none; then every output position gets the same correction
    (s - z) * sum_{c,kh,kw} W[m]. None where this does not apply (the float lowering does)."""
    atype = lw.types.get(x)
    if atype not in SHIFT or lw.ranks.get(x) != 4 or int(attrs.get("group", 1)) != 1 \
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    x8 = _padded_int8(lw, x, x_zp, SHIFT[atype], pads) if any(pads) else _shifted_int8(lw, x, SHIFT[atype])
    conv_attrs = {k: v for k, v in attrs.items() if k in ("strides", "dilations", "kernel_shape")}
    acc = lw.op("ConvInteger", [x8, w_name], **conv_attrs)
    sums = np.asarray(w, np.int64).sum(axis=(1, 2, 3)).astype(np.int32).reshape(1, -1, 1, 1)
    return _corrected(lw, acc, SHIFT[atype], x_zp, sums)


def _padded_int8(lw, x: str, zp: str | None, shift: int, pads: list) -> str:
    """x - shift as int8, padded with zp - shift (the zero point may be computed at run time, and
    Pad takes a constant value only): Cast(Pad(x - zp, 0) + (zp - shift)), exact in float32."""
    xf = lw.to_float(x)
    z = lw.to_float(zp) if zp is not None else None
    centred = lw.op("Sub", [xf, z]) if z is not None else xf
    padded = lw.op("Pad", [centred, lw.const([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]], np.int64, "pf_q_pads")])
    offset = lw.op("Sub", [z, lw.const(float(shift))]) if z is not None else lw.const(-float(shift))
    return lw.op("Cast", [lw.op("Add", [padded, offset])], to=TensorProto.INT8)


def _shifted_int8(lw, a: str, shift: int) -> str:
    """a - shift as int8 (a no-op for int8 tensors): one elementwise step, fused into a's producer."""
    if not shift:
        return a
    return lw.op("Cast", [lw.op("Sub", [lw.to_float(a), lw.const(float(shift))])], to=TensorProto.INT8)


def _corrected(lw, acc: str, shift: int, zp: str | None, sums: np.ndarray) -> str:
    """acc + (shift - zp) * sums in int32: a constant vector when zp is, else computed at run time."""
    if zp is None or zp in lw.consts:
        z = int(np.asarray(lw.consts[zp]).reshape(-1)[0]) if zp else 0
        fix = ((shift - z) * sums.astype(np.int64)).astype(np.int32)
        return lw.op("Add", [acc, lw.const(fix, np.int32, "pf_q_colsum")]) if np.any(fix) else acc
    step = lw.op("Sub", [lw.const(shift, np.int32, "pf_q_shift"), lw.op("Cast", [zp], to=TensorProto.INT32)])
    return lw.op("Add", [acc, lw.op("Mul", [step, lw.const(sums, np.int32, "pf_q_colsum")])])


# ---- QDQ MatMul / Gemm -> MatMulInteger, before the weight's DequantizeLinear is folded ----

def fuse_qdq_integer(model: onnx.ModelProto) -> onnx.ModelProto:
    """MatMul / Gemm / Conv of two DequantizeLinear outputs, the second of a constant int8 weight
    with zero point 0 -> MatMulInteger(q_a, W, z_a) * (a_scale * w_scale) (+ C), likewise
    ConvInteger (in place; returned). Redundant Q/DQ pairs around moves go first (requantize.py)."""
    g = model.graph
    if not any(n.op_type == "DequantizeLinear" for n in g.node):
        return model
    from powerfusion.precision.requantize import drop_requantize_pairs
    drop_requantize_pairs(model)    # first, so the rewrites below see the simplified graph
    producers = {o: n for n in g.node for o in n.output}
    inits = {t.name: t for t in g.initializer}
    types = _elem_types(model)
    from powerfusion.names import fresh_name
    taken = {n for node in g.node for n in list(node.input) + list(node.output)} | set(inits)
    nodes, changed = [], False
    for node in g.node:
        new = _rewrite(node, producers, inits, types, lambda base: fresh_name(base, taken), g)
        changed |= new is not None
        nodes.extend([node] if new is None else new)
    if changed:
        del g.node[:]
        g.node.extend(nodes)
    return model


def _elem_types(model) -> dict:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _dq_parts(name, producers, inits):
    """(x, scale, zp, axis) of a plain DequantizeLinear producing `name`, else None."""
    dq = producers.get(name)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or _attr(dq, "block_size", 0):
        return None
    ins = list(dq.input) + ["", ""]
    return ins[0], ins[1], ins[2] or None, _attr(dq, "axis", 1)


def _const(inits, name):
    return numpy_helper.to_array(inits[name]) if name in inits else None


def _rewrite(node, producers, inits, types, fresh, g):
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm", "Conv") or len(node.input) < 2:
        return None
    if node.op_type == "Conv":
        return _rewrite_conv(node, producers, inits, types, fresh, g)
    trans_b = node.op_type == "Gemm" and bool(_attr(node, "transB", 0))
    if node.op_type == "Gemm" and (_attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0
                                   or (len(node.input) > 2 and node.input[2] and _attr(node, "beta", 1.0) != 1.0)):
        return None
    pa, pw = _dq_parts(node.input[0], producers, inits), _dq_parts(node.input[1], producers, inits)
    if pa is None or pw is None or pa[0] in inits or types.get(pa[0]) not in SHIFT:
        return None
    a_scale, a_zp = _const(inits, pa[1]), _const(inits, pa[2]) if pa[2] else None
    w, w_scale = _const(inits, pw[0]), _const(inits, pw[1])
    if a_scale is None or a_scale.size != 1 or (pa[2] and (a_zp is None or a_zp.size != 1)):
        return None
    if w is None or w.dtype != np.int8 or w.ndim != 2 or w_scale is None:
        return None
    if pw[2] and (_const(inits, pw[2]) is None or np.any(_const(inits, pw[2]) != 0)):
        return None
    n_axis = 0 if trans_b else 1
    if w_scale.size != 1 and (w_scale.ndim != 1 or pw[3] % 2 != n_axis or w_scale.size != w.shape[n_axis]):
        return None
    w_name = pw[0]
    if trans_b:
        w_name = fresh("pf_q_weight_t")
        g.initializer.append(numpy_helper.from_array(np.asarray(w.T, order="C"), w_name))
    scale_name = fresh("pf_q_scale")
    scale = (a_scale.astype(np.float32).reshape(()) * w_scale.astype(np.float32).reshape(-1)).astype(np.float32)
    g.initializer.append(numpy_helper.from_array(scale if scale.size > 1 else scale.reshape(()), scale_name))
    acc, accf = fresh("pf_q_acc"), fresh("pf_q_accf")
    ins = [pa[0], w_name] + ([pa[2]] if pa[2] else [])
    out = [helper.make_node("MatMulInteger", ins, [acc], name=fresh(f"{node.name or 'matmul'}_int8")),
           helper.make_node("Cast", [acc], [accf], to=TensorProto.FLOAT, name=fresh("pf_q_cast"))]
    has_c = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
    y = fresh("pf_q_scaled") if has_c else node.output[0]
    out.append(helper.make_node("Mul", [accf, scale_name], [y], name=fresh("pf_q_mul")))
    if has_c:
        out.append(helper.make_node("Add", [y, node.input[2]], [node.output[0]], name=fresh("pf_q_add")))
    return out


def _rewrite_conv(node, producers, inits, types, fresh, g):
    """Conv(DequantizeLinear(q_x), DequantizeLinear(W int8, per tensor or per output channel)
    [, B]) -> ConvInteger(q_x, W, z_x) * scale[1, M, 1, 1] (+ B[1, M, 1, 1])."""
    px, pw = _dq_parts(node.input[0], producers, inits), _dq_parts(node.input[1], producers, inits)
    if px is None or pw is None or px[0] in inits or types.get(px[0]) not in SHIFT:
        return None
    x_scale, x_zp = _const(inits, px[1]), _const(inits, px[2]) if px[2] else None
    w, w_scale = _const(inits, pw[0]), _const(inits, pw[1])
    if x_scale is None or x_scale.size != 1 or (px[2] and (x_zp is None or x_zp.size != 1)):
        return None
    if w is None or w.dtype != np.int8 or w.ndim != 4 or w_scale is None:
        return None
    if pw[2] and (_const(inits, pw[2]) is None or np.any(_const(inits, pw[2]) != 0)):
        return None
    m = w.shape[0]
    if w_scale.size != 1 and (w_scale.ndim != 1 or pw[3] % 4 != 0 or w_scale.size != m):
        return None
    scale = (x_scale.astype(np.float32).reshape(()) * w_scale.astype(np.float32).reshape(-1)).astype(np.float32)
    scale_name = fresh("pf_q_scale")
    g.initializer.append(numpy_helper.from_array(scale.reshape(1, -1, 1, 1) if scale.size > 1 else scale.reshape(()),
                                                 scale_name))
    acc, accf = fresh("pf_q_acc"), fresh("pf_q_accf")
    ins = [px[0], pw[0]] + ([px[2]] if px[2] else [])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out = [helper.make_node("ConvInteger", ins, [acc], name=fresh(f"{node.name or 'conv'}_int8"), **attrs),
           helper.make_node("Cast", [acc], [accf], to=TensorProto.FLOAT, name=fresh("pf_q_cast"))]
    has_b = len(node.input) > 2 and node.input[2]
    y = fresh("pf_q_scaled") if has_b else node.output[0]
    out.append(helper.make_node("Mul", [accf, scale_name], [y], name=fresh("pf_q_mul")))
    if has_b:
        shape = fresh("pf_q_bias_shape")
        g.initializer.append(numpy_helper.from_array(np.array([1, m, 1, 1], np.int64), shape))
        b4 = fresh("pf_q_bias")
        out += [helper.make_node("Reshape", [node.input[2], shape], [b4], name=fresh("pf_q_reshape")),
                helper.make_node("Add", [y, b4], [node.output[0]], name=fresh("pf_q_add"))]
    return out
