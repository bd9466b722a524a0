"""Weight-quantized MatMuls -> `TypedMatMul` (a typed low-precision GEMM, powerfusion.ttile).

Two ONNX forms are recognised:

* `com.microsoft.MatMulNBits` (what `powerfusion.quantize_weights` and onnxruntime's
  quantisers write): B, scales and zero_points must be constants; g_idx is refused.
* `ai.powerfusion.MatMulLowBit` (what `powerfusion quantize-weights` writes for the weight
  types MatMulNBits cannot hold: NF4, FP4, MXFP4, FP8, INT1, and int8 activations;
  defined in docs/ttile.md): B and scales (and bias) must be constants.
* `DequantizeLinear(x, x_scale[, x_zero_point]) -> MatMul(A, .)` with x a constant 2-D
  int4/uint4/int8/uint8 initializer whose only consumer is MatMul's input 1, scales per
  output column (axis 1) or blocked along K (axis 0, block_size). Folding would turn the
  DequantizeLinear into a float weight, so `fuse_dequantize_matmul` runs before it and
  replaces the pair by one node `DequantizeMatMul` in the private domain PF_DOMAIN.
  A DequantizeLinear outside this pattern is folded when its inputs are constants (giving
  an ordinary float MatMul) and reported as unsupported otherwise.

onnx shape inference knows neither node, so `inference_stand_ins` replaces them, in the
copy that inference runs on, by MatMul(A, W) with W a [K, N] graph input typed like the
scales: the same output shape and type.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from powerfusion.basic import TypedMatMul

MS_DOMAIN = "com.microsoft"
PF_DOMAIN = "ai.powerfusion"
# (domain, op type) -> the source recorded in TypedMatMul
QUANTIZED_OPS = {(MS_DOMAIN, "MatMulNBits"): "MatMulNBits", (PF_DOMAIN, "DequantizeMatMul"): "DequantizeLinear",
                 (PF_DOMAIN, "MatMulLowBit"): "MatMulLowBit"}
DQ_WEIGHT_DTYPES = ("int4", "uint4", "int8", "uint8")
_FLOAT_ONNX = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def is_quantized(node: onnx.NodeProto) -> bool:
    return (node.domain, node.op_type) in QUANTIZED_OPS


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# ---- before folding -------------------------------------------------------------------

def fuse_dequantize_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """DequantizeLinear(const x) -> MatMul(A, .) pairs -> DequantizeMatMul(A, x, scale[, zp]) (in place)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    users: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    fused: dict[int, onnx.NodeProto] = {}   # id(MatMul) -> its replacement
    dropped = set()
    for dq in g.node:
        if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or not _fusable(dq, inits):
            continue
        consumers = users.get(dq.output[0], [])
        if len(consumers) != 1 or dq.output[0] in graph_outputs:
            continue
        mm = consumers[0]
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or list(mm.input).index(dq.output[0]) != 1:
            continue
        fused[id(mm)] = helper.make_node("DequantizeMatMul", [mm.input[0]] + list(dq.input), list(mm.output),
                                         name=mm.name or dq.name, domain=PF_DOMAIN, **_attrs(dq))
        dropped.add(id(dq))
    if not fused:
        return model
    nodes = [fused.get(id(n), n) for n in g.node if id(n) not in dropped]
    del g.node[:]
    g.node.extend(nodes)
    if not any(o.domain == PF_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PF_DOMAIN, 1))
    return model


def _fusable(dq, inits) -> bool:
    names = list(dq.input) + [""]
    if any(n and n not in inits for n in names[:3]) or not names[1]:
        return False
    x, s = inits[names[0]], inits[names[1]]
    if len(x.dims) != 2 or onnx.helper.tensor_dtype_to_np_dtype(x.data_type).name not in DQ_WEIGHT_DTYPES:
        return False
    at = _attrs(dq)
    axis, bs = at.get("axis", 1), at.get("block_size", 0)
    if axis % 2 == 1 and len(s.dims) <= 1 and not bs:
        return int(np.prod(s.dims, dtype=np.int64)) in (1, x.dims[1])
    return axis % 2 == 0 and bs > 0 and len(s.dims) == 2 and tuple(s.dims) == (-(-x.dims[0] // bs), x.dims[1])


# ---- shape inference --------------------------------------------------------------------

def inference_stand_ins(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace quantized nodes by MatMul(A, [K, N] input) in `model` (a copy inference runs on)."""
    g = model.graph
    if not any(is_quantized(n) for n in g.node):
        return model
    types = {t.name: t.data_type for t in g.initializer}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info)})
    dims = {t.name: tuple(t.dims) for t in g.initializer}
    dims.update({vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim) for vi in g.input})
    taken = {n for node in g.node for n in list(node.input) + list(node.output)} | set(types)
    nodes = []
    for k, n in enumerate(g.node):
        if not is_quantized(n):
            nodes.append(n)
            continue
        at = _attrs(n)
        if n.op_type == "MatMulNBits":
            K, N, scale = at.get("K"), at.get("N"), n.input[2] if len(n.input) > 2 else ""
        elif n.op_type == "MatMulLowBit":   # typed like A where A's type is known (mxfp4 scales are
            K, N = at.get("K"), at.get("N")  # uint8 codes, a bfloat16 model's scales float32)
            scale = n.input[0] if types.get(n.input[0]) in _FLOAT_ONNX else (n.input[2] if len(n.input) > 2 else "")
        else:
            (K, N), scale = dims.get(n.input[1], (None, None)), n.input[2]
        if K is None or N is None or scale not in types:
            nodes.append(n)     # left as it is: the converter reports what is missing
            continue
        stub = f"pf_stand_in_{k}"
        while stub in taken:
            stub += "_"
        g.input.append(helper.make_tensor_value_info(stub, types[scale], [K, N]))
        nodes.append(helper.make_node("MatMul", [n.input[0], stub], list(n.output), name=n.name))
    del g.node[:]
    g.node.extend(nodes)
    return model


# ---- conversion -------------------------------------------------------------------------

def check_quantized(cx) -> str | None:
    """Why a MatMulNBits / DequantizeMatMul node cannot become a TypedMatMul (None if it can)."""
    node, at = cx.node, cx.attrs
    a = cx.inferred(node.input[0])
    if a is None or not a.shape:
        return f"input 0 ('{node.input[0]}') has no static shape"
    if np.dtype(a.dtype).name not in FLOAT_DTYPES:
        return f"input A has dtype {np.dtype(a.dtype).name}; float32, float16 or bfloat16 expected"
    if node.op_type == "MatMulNBits":
        if at.get("bits", 4) not in (2, 4, 8):
            return f"bits={at.get('bits')} (2, 4 or 8 supported)"
        if "K" not in at or "N" not in at or "block_size" not in at:
            return "attributes K, N and block_size are required"
        if cx.has(4):
            return "g_idx (act-order) is not supported"
        for i in (1, 2, 3, 5):
            if cx.has(i) and cx.const(i) is None:
                return f"input {i} ('{node.input[i]}') must be a constant"
        K = at["K"]
    elif node.op_type == "MatMulLowBit":
        reason = _check_lowbit(cx)
        if reason:
            return reason
        K = at["K"]
    else:
        K = cx.const(1).shape[0]
    if a.shape[-1] != K:
        return f"A's last dimension {a.shape[-1]} is not K = {K}"
    return None


def _check_lowbit(cx) -> str | None:
    """Attributes and constants of a MatMulLowBit, checked by ttile (the op's definition)."""
    for i in (1, 2, 3):
        if cx.has(i) and cx.const(i) is None:
            return f"input {i} ('{cx.node.input[i]}') must be a constant"
    from powerfusion.ttile.onnx_lowbit import lowbit_problem
    return lowbit_problem(cx.node, {cx.node.input[i]: cx.const(i) for i in (1, 2, 3) if cx.has(i)})


def convert_quantized(cx) -> None:
    node, at = cx.node, cx.attrs
    a = cx.info(node.input[0])
    if node.op_type == "MatMulNBits":
        K, N, bits, bs = at["K"], at["N"], at.get("bits", 4), at["block_size"]
        slots = tuple(i for i in (1, 2, 3, 5) if cx.has(i))
        op = TypedMatMul("MatMulNBits", bits, bs, K, N, tuple(sorted(at.items())), slots)
        consts = [cx.inp(i) for i in slots]
    elif node.op_type == "MatMulLowBit":
        from powerfusion.ttile.ttype import get_ttype
        K, N, bs = at["K"], at["N"], at["block_size"]
        slots = tuple(i for i in (1, 2, 3) if cx.has(i))
        wd = at["weight_dtype"]
        op = TypedMatMul("MatMulLowBit", get_ttype(wd.decode() if isinstance(wd, bytes) else wd).bits, bs, K, N, tuple(sorted(at.items())), slots)
        consts = [cx.inp(i) for i in slots]
    else:
        x = cx.const(1)
        K, N = x.shape
        bits = 4 if "4" in np.dtype(x.dtype).name else 8
        bs = at.get("block_size", 0) if at.get("axis", 1) % 2 == 0 else K
        slots = tuple(i - 1 for i in (1, 2, 3) if cx.has(i))   # DequantizeLinear's x, x_scale, x_zero_point
        op = TypedMatMul("DequantizeLinear", bits, bs, K, N, tuple(sorted(at.items())), slots)
        consts = [cx.inp(i) for i in (1, 2, 3) if cx.has(i)]
    cx.emit(op, [cx.inp(0)] + consts, tuple(a.shape[:-1]) + (N,), a.dtype, out=cx.out())


# ---- rebuilding the ONNX node, numpy execution ----------------------------------------

def source_node(op: TypedMatMul, names: list[str]) -> onnx.NodeProto:
    """The source ONNX node over `names` (A, *constants); a DequantizeLinear's output is 'W'."""
    ins = [""] * (max(op.slots) + 1 if op.slots else 0)
    for slot, name in zip(op.slots, names[1:]):
        ins[slot] = name
    if op.source == "MatMulNBits":
        ins[0] = names[0]
        node = helper.make_node("MatMulNBits", ins, ["Y"], domain=MS_DOMAIN, **dict(op.attrs))
    elif op.source == "MatMulLowBit":
        ins[0] = names[0]
        node = helper.make_node("MatMulLowBit", ins, ["Y"], domain=PF_DOMAIN, **dict(op.attrs))
    else:
        node = helper.make_node("DequantizeLinear", ins, ["W"], **dict(op.attrs))
    return node


def run_typed_matmul(op: TypedMatMul, args, dtype) -> np.ndarray:
    """numpy: MatMulNBits through ttile's reference; DequantizeLinear rounded to the scale dtype
    (as ONNX does) and then a float64 MatMul."""
    a = np.asarray(args[0])
    if op.source in ("MatMulNBits", "MatMulLowBit"):
        from powerfusion.ttile.onnx_lowbit import matmul_lowbit_reference
        from powerfusion.ttile.onnx_quant import matmul_nbits_reference
        inputs: list = [None] * (max(op.slots) + 1)
        inputs[0] = a
        for slot, v in zip(op.slots, args[1:]):
            inputs[slot] = np.asarray(v)
        names = ["A"] + [""] * max(op.slots)
        for slot in op.slots:
            names[slot] = f"c{slot}"
        ref = matmul_nbits_reference if op.source == "MatMulNBits" else matmul_lowbit_reference
        return ref(source_node(op, [names[0]] + [names[s] for s in op.slots]), inputs).astype(dtype)
    w = dequantize(op, [np.asarray(v) for v in args[1:]])
    return (a.astype(np.float64) @ w.astype(np.float64)).astype(dtype)


def dequantize(op: TypedMatMul, consts: list[np.ndarray]) -> np.ndarray:
    """ONNX DequantizeLinear of the [K, N] weight, in the scale's dtype."""
    x, s = consts[0].astype(np.int64), consts[1]
    z = consts[2].astype(np.int64) if len(consts) > 2 else np.zeros((), np.int64)
    if op.block_size == op.K and dict(op.attrs).get("axis", 1) % 2 == 1:   # per output column
        w = (x - z.reshape(1, -1)) * s.astype(np.float64).reshape(1, -1)
    else:
        rep = lambda v: np.repeat(v, op.block_size, axis=0)[:op.K]          # noqa: E731
        w = (x - (rep(z) if z.ndim else z)) * rep(s.astype(np.float64))
    return w.astype(s.dtype)


def packed_bytes(graph, node) -> int:
    """Compulsory bytes of a TypedMatMul: A and Y, the weight at `bits` per element, scales etc."""
    op = node.op
    weight = node.inputs[1]
    rest = sum(graph.tensors[t].nbytes for t in set(node.inputs) if t != weight)
    return rest + graph.tensors[node.outputs[0]].nbytes + -(-op.K * op.N * op.bits // 8)
