"""Quantised ONNX ops -> standard float / integer ops the frontend already compiles.

QuantizeLinear, DequantizeLinear (around activations; a DequantizeLinear of a constant weight
feeding a MatMul is taken earlier, as a typed GEMM: frontend/quantized.py), QLinearMatMul,
QLinearConv, MatMulInteger, ConvInteger and DynamicQuantizeLinear are rewritten into
Cast / Sub / Mul / Div / Round / Clip / MatMul / Conv / ReduceMin / ReduceMax, following the
ONNX definitions and onnxruntime's CPU kernels:

    quantize(x)   = saturate(round_half_even(x / scale) + zero_point)
    dequantize(q) = (q - zero_point) * scale
    QLinear*(..)  = saturate(round_half_even(acc * (a_scale * b_scale / y_scale)) + y_zero_point),
                    acc = sum((a - a_zero_point) * (b - b_zero_point)) (+ bias)

MatMulInteger, QLinearMatMul, ConvInteger and QLinearConv (and QDQ MatMuls / Convs, rewritten
into the *Integer ops by integer_gemm.fuse_qdq_integer) with a constant int8 weight of zero
point 0 (2-D convolutions of one group) accumulate in an int8 x int8 -> int32 GEMM /
convolution with the zero points folded out (integer_gemm.py): integer tensor cores on CUDA.
The other accumulations run as a float32 MatMul / Conv of the zero-point-shifted integers:
exact while |acc| < 2**24 (int8 x int8 products of at most 2**15, so any K below 512, and in
practice far beyond, as products of both signs cancel); larger sums may round the last bit,
which moves a requantised output by at most one step. This keeps the GEMMs on the library path of every
backend. The (de)quantisation itself
becomes elementwise basic ops, which the partition keeps in memory-bound subgraphs next to
their neighbours.

Variants we do not lower (block-wise scales, int4 / int16 / float8 types, per-row zero points
of MatMulInteger's A) are left as they are, so the frontend reports them as unsupported.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

QUANT_TYPES = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255)}
QUANTIZED_OP_TYPES = ("QuantizeLinear", "DequantizeLinear", "QLinearMatMul", "QLinearConv",
                      "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear")


def has_quantized_ops(model: onnx.ModelProto) -> bool:
    return any(n.op_type in QUANTIZED_OP_TYPES and n.domain in ("", "ai.onnx") for n in model.graph.node)


def lower_quantized_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every quantised op we can lower replaced (in place; returned)."""
    if not has_quantized_ops(model):
        return model
    lw = _Lowering(model)
    nodes = []
    for node in model.graph.node:
        fn = LOWERINGS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        out = fn(lw, node) if fn is not None else None
        nodes.extend([node] if out is None else out)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]
    return model


class _Lowering:
    """Node and constant factory with fresh names; types and ranks from shape inference."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        inferred = onnx.shape_inference.infer_shapes(model)
        self.types, self.ranks = {}, {}
        for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
            tt = vi.type.tensor_type
            self.types[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                self.ranks[vi.name] = len(tt.shape.dim)
        self.consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        for t in g.initializer:
            self.types[t.name], self.ranks[t.name] = t.data_type, len(t.dims)
        self.graph = g
        self.taken = {n for node in g.node for n in list(node.input) + list(node.output)} | set(self.consts)
        self.new: list = []

    def fresh(self, base: str) -> str:
        from powerfusion.names import fresh_name
        return fresh_name(base, self.taken)

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.fresh(f"pf_q_{op_type.lower()}")
        self.new.append(helper.make_node(op_type, inputs, [out], name=self.fresh(f"{out}_node"), **attrs))
        return out

    def const(self, value, dtype=np.float32, base: str = "pf_q_const") -> str:
        name = self.fresh(base)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        self.types[name] = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        return name

    def to_float(self, name: str) -> str:
        if self.types.get(name) == TensorProto.FLOAT:
            return name
        out = self.op("Cast", [name], to=TensorProto.FLOAT)
        self.types[out] = TensorProto.FLOAT
        if name in self.ranks:
            self.ranks[out] = self.ranks[name]
        return out

    def divide(self, x: str, scale: str) -> str:
        """x / scale as a true division where the scale is computed at run time (the frontend
        would multiply by the reciprocal of a shared divisor, one ulp off onnxruntime's x / s
        and so one step off at rounding ties); a constant scale still becomes a reciprocal."""
        if scale not in self.consts:
            scale = self.op("Expand", [scale, self.op("Shape", [x])])
        return self.op("Div", [x, scale])

    def per_axis(self, name: str, axis: int, rank: int) -> str:
        """A 1-D per-channel tensor reshaped to broadcast along `axis` of a rank-`rank` tensor."""
        if self.ranks.get(name) == 1 and rank > 1 and axis % rank != rank - 1:
            shape = [1] * rank
            shape[axis % rank] = -1
            return self.op("Reshape", [name, self.const(shape[axis % rank:], np.int64, "pf_q_shape")])
        return name

    def take(self) -> list:
        out, self.new = self.new, []
        return out


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _zp(node, i) -> str | None:
    return node.input[i] if len(node.input) > i and node.input[i] else None


def _quant_type(lw: _Lowering, node, zp_index: int, default=TensorProto.UINT8) -> int | None:
    zp = _zp(node, zp_index)
    t = lw.types.get(zp) if zp else default
    return t if t in QUANT_TYPES else None


def _saturate(lw: _Lowering, x: str, zp: str | None, qtype: int, out: str) -> str:
    """Cast(Clip(Round(x) + zp, lo, hi), qtype) with x already divided by the scale."""
    lo, hi = QUANT_TYPES[qtype]
    y = lw.op("Round", [x])
    if zp is not None:
        y = lw.op("Add", [y, lw.to_float(zp)])
    y = lw.op("Clip", [y, lw.const(lo), lw.const(hi)])
    return lw.op("Cast", [y], out, to=qtype)


def _plain(node) -> bool:
    return not _attr(node, "block_size", 0)


def lower_quantize(lw: _Lowering, node):
    qtype = _quant_type(lw, node, 2, _attr(node, "output_dtype", 0) or TensorProto.UINT8)
    x = node.input[0]
    if qtype is None or not _plain(node) or lw.types.get(x) != TensorProto.FLOAT or x not in lw.ranks:
        return None
    axis, rank = _attr(node, "axis", 1), lw.ranks[x]
    scale = lw.per_axis(lw.to_float(node.input[1]), axis, rank)
    zp = _zp(node, 2)
    zp = lw.per_axis(zp, axis, rank) if zp else None
    _saturate(lw, lw.divide(x, scale), zp, qtype, node.output[0])
    return lw.take()


def lower_dequantize(lw: _Lowering, node):
    x = node.input[0]
    if lw.types.get(x) not in (*QUANT_TYPES, TensorProto.INT32) or not _plain(node) or x not in lw.ranks:
        return None
    if lw.types.get(node.input[1]) != TensorProto.FLOAT:
        return None
    axis, rank = _attr(node, "axis", 1), lw.ranks[x]
    y = lw.to_float(x)
    zp = _zp(node, 2)
    if zp:
        y = lw.op("Sub", [y, lw.per_axis(lw.to_float(zp), axis, rank)])
    lw.op("Mul", [y, lw.per_axis(node.input[1], axis, rank)], node.output[0])
    return lw.take()


def _shifted(lw: _Lowering, q: str, zp: str | None, axis: int | None = None, rank: int = 0) -> str:
    y = lw.to_float(q)
    if zp:
        z = lw.to_float(zp)
        y = lw.op("Sub", [y, lw.per_axis(z, axis, rank) if axis is not None else z])
    return y


def _scalar(lw: _Lowering, name: str | None) -> bool:
    return name is None or lw.ranks.get(name) == 0 or (name in lw.consts and lw.consts[name].size == 1)


def lower_matmul_integer(lw: _Lowering, node):
    a, b = node.input[0], node.input[1]
    if lw.types.get(a) not in QUANT_TYPES or lw.types.get(b) not in QUANT_TYPES or not _scalar(lw, _zp(node, 2)):
        return None
    acc = _integer_acc(lw, a, _zp(node, 2), b, _zp(node, 3))
    if acc is not None:
        lw.op("Identity", [acc], node.output[0])
        return lw.take()
    acc = lw.op("MatMul", [_shifted(lw, a, _zp(node, 2)), _shifted(lw, b, _zp(node, 3))])
    lw.op("Cast", [acc], node.output[0], to=TensorProto.INT32)
    return lw.take()


def _integer_acc(lw: _Lowering, a: str, a_zp: str | None, b: str, b_zp: str | None) -> str | None:
    """The int32 accumulator through an int8 x int8 integer GEMM (integer_gemm.py) where B is a
    constant int8 weight with zero point 0; None otherwise (the float lowering applies)."""
    from powerfusion.precision.integer_gemm import int8_weight, integer_product
    w = int8_weight(lw, b, b_zp)
    return None if w is None else integer_product(lw, a, a_zp, b, w)


def lower_qlinear_matmul(lw: _Lowering, node):
    a, b = node.input[0], node.input[3]
    qtype = _quant_type(lw, node, 7)
    if qtype is None or lw.types.get(a) not in QUANT_TYPES or lw.types.get(b) not in QUANT_TYPES \
            or not _scalar(lw, _zp(node, 2)):
        return None
    acc = _integer_acc(lw, a, _zp(node, 2), b, _zp(node, 5))
    acc = lw.op("MatMul", [_shifted(lw, a, _zp(node, 2)), _shifted(lw, b, _zp(node, 5))]) if acc is None \
        else lw.to_float(acc)
    mult = lw.op("Div", [lw.op("Mul", [node.input[1], node.input[4]]), node.input[6]])
    _saturate(lw, lw.op("Mul", [acc, mult]), _zp(node, 7), qtype, node.output[0])
    return lw.take()


def _conv_attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def lower_conv_integer(lw: _Lowering, node):
    x, w = node.input[0], node.input[1]
    if lw.types.get(x) not in QUANT_TYPES or lw.types.get(w) not in QUANT_TYPES or not _scalar(lw, _zp(node, 2)) \
            or w not in lw.ranks:
        return None
    acc = _integer_conv_acc(lw, x, _zp(node, 2), w, _zp(node, 3), node)
    if acc is not None:
        lw.op("Identity", [acc], node.output[0])
        return lw.take()
    wf = _shifted(lw, w, _zp(node, 3), 0, lw.ranks[w])
    acc = lw.op("Conv", [_shifted(lw, x, _zp(node, 2)), wf], **_conv_attrs(node))
    lw.op("Cast", [acc], node.output[0], to=TensorProto.INT32)
    return lw.take()


def _integer_conv_acc(lw: _Lowering, x: str, x_zp: str | None, w: str, w_zp: str | None, node) -> str | None:
    """The int32 accumulator through an int8 x int8 integer convolution (integer_gemm.py) where W
    is a constant int8 weight with zero point 0; None otherwise (the float lowering applies)."""
    from powerfusion.precision.integer_gemm import int8_conv_weight, integer_conv
    wc = int8_conv_weight(lw, w, w_zp)
    return None if wc is None else integer_conv(lw, x, x_zp, w, wc, _conv_attrs(node))


def lower_qlinear_conv(lw: _Lowering, node):
    x, w = node.input[0], node.input[3]
    qtype = _quant_type(lw, node, 7)
    if qtype is None or lw.types.get(x) not in QUANT_TYPES or lw.types.get(w) not in QUANT_TYPES \
            or not _scalar(lw, _zp(node, 2)) or w not in lw.ranks:
        return None
    rank = lw.ranks[w]
    has_bias = len(node.input) > 8 and node.input[8]
    acc = _integer_conv_acc(lw, x, _zp(node, 2), w, _zp(node, 5), node)
    if acc is not None:
        acc = lw.to_float(acc)
        if has_bias:
            acc = lw.op("Add", [acc, lw.per_axis(lw.to_float(node.input[8]), 1, rank)])
    else:
        ins = [_shifted(lw, x, _zp(node, 2)), _shifted(lw, w, _zp(node, 5), 0, rank)]
        if has_bias:
            ins.append(lw.to_float(node.input[8]))
        acc = lw.op("Conv", ins, **_conv_attrs(node))
    mult = lw.op("Div", [lw.op("Mul", [node.input[1], lw.per_axis(node.input[4], 1, rank)]), node.input[6]])
    _saturate(lw, lw.op("Mul", [acc, mult]), _zp(node, 7), qtype, node.output[0])
    return lw.take()


def lower_dynamic_quantize(lw: _Lowering, node):
    """ONNX DynamicQuantizeLinear (uint8): the range always includes 0."""
    x = node.input[0]
    if lw.types.get(x) != TensorProto.FLOAT:
        return None
    zero = lw.const(0.0)
    lo = lw.op("Min", [lw.op("ReduceMin", [x], keepdims=0), zero])
    hi = lw.op("Max", [lw.op("ReduceMax", [x], keepdims=0), zero])
    y, y_scale, zp_out = (list(node.output) + ["", ""])[:3]
    scale = lw.op("Div", [lw.op("Sub", [hi, lo]), lw.const(255.0)], y_scale or None)
    zp = lw.op("Clip", [lw.op("Round", [lw.op("Sub", [zero, lw.op("Div", [lo, scale])])]),
                        lw.const(0.0), lw.const(255.0)])
    if zp_out:
        lw.op("Cast", [zp], zp_out, to=TensorProto.UINT8)
    if y:
        _saturate(lw, lw.divide(x, scale), zp, TensorProto.UINT8, y)
    return lw.take()


LOWERINGS = {
    "QuantizeLinear": lower_quantize, "DequantizeLinear": lower_dequantize,
    "MatMulInteger": lower_matmul_integer, "QLinearMatMul": lower_qlinear_matmul,
    "ConvInteger": lower_conv_integer, "QLinearConv": lower_qlinear_conv,
    "DynamicQuantizeLinear": lower_dynamic_quantize,
}
