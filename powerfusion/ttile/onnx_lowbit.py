"""`ai.powerfusion.MatMulLowBit`: the one ONNX op for low-bit weights that
com.microsoft.MatMulNBits cannot express (NF4, FP4, MXFP4, FP8, INT1 weights; int8
activations). Its definition is in docs/ttile.md ("MatMulLowBit"):

    Y[..., N] = A[..., K] @ W^T (+ bias),  W[n, k] = value(code[n, k]) * scale[n, k // block_size]

- inputs: A (float), B (uint8 [N, blocks, block_size * bits / 8]: per row and block an
  LSB-first bitstream of element codes, as MatMulNBits), scales ([N * blocks], the model's
  float type; uint8 e8m0 codes for mxfp4), optional bias ([N]).
- attributes: K, N, block_size, weight_dtype (a tType name), act_dtype ("" or "int8").
- act_dtype "int8": each row of A is first rounded to int8 with its own scale
  s = max|row| / 127 (1 for an all-zero row), round half to even, and Y = s * (q_A @ W^T).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from powerfusion.errors import NodeError

from .onnx_quant import _nbits_weight, _unique, copy_with_uses
from .quant import QuantizedWeight, pack_bits, quantize, quantize_rows_int8, unpack_bits
from .ttype import e8m0_decode, get_ttype

PF_DOMAIN = "ai.powerfusion"
OP_TYPE = "MatMulLowBit"
# weight types the op carries (every one has a fused fp16 / bf16 kernel); int8 activations: these only
LOWBIT_WTYPES = ("int4", "int2", "int1", "nf4", "fp4_e2m1", "mxfp4", "fp8_e4m3")
INT8_ACT_WTYPES = ("int4", "int2", "int1")
ACT_DTYPES = ("", "int8")


def _attrs(node) -> dict:
    out = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for k in ("weight_dtype", "act_dtype"):
        if isinstance(out.get(k), bytes):
            out[k] = out[k].decode()
    return out


def check_lowbit_args(W_dtype: str, group_size: int | None, act_dtype: str = "") -> int:
    """The block size MatMulLowBit stores for these flags; ValueError naming the bad one."""
    if W_dtype not in LOWBIT_WTYPES:
        raise ValueError(f"weight dtype {W_dtype!r} is not one of {LOWBIT_WTYPES}")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"activation dtype {act_dtype!r}: only int8 (or none) is supported")
    if act_dtype == "int8" and W_dtype not in INT8_ACT_WTYPES:
        raise ValueError(f"int8 activations have kernels for {INT8_ACT_WTYPES} weights only, not {W_dtype}")
    tt = get_ttype(W_dtype)
    if tt.kind == "block":
        if group_size not in (None, tt.block):
            raise ValueError(f"{W_dtype} has a fixed block of {tt.block} elements; group {group_size} given")
        return tt.block
    if group_size is None or group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"group size must be a power of two >= 32, got {group_size}")
    return group_size


def lowbit_node(name: str, a: str, out: str, weight: np.ndarray, W_dtype: str, block: int,
                act_dtype: str, scale_dtype) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """One MatMulLowBit for the float weight [K, N] and its initializers (named after `name`)."""
    K, N = weight.shape
    tt = get_ttype(W_dtype)
    qw = quantize(weight.T, W_dtype, block if block < K else -1)
    blocks = -(-K // block)
    pad_code = 0 if tt.kind not in ("int", "uint") else (1 << (tt.bits - 1))  # zero value of the type
    codes = np.full((N, blocks * block), pad_code, np.uint8)
    codes[:, :K] = qw.codes
    scale = qw.scale
    if scale.shape[1] != blocks:                 # per channel (block >= K): one scale per block
        scale = np.repeat(scale, blocks, axis=1)
    blob = pack_bits(codes.reshape(N, blocks, block), tt.bits)
    sc = scale.reshape(-1) if tt.kind == "block" else scale.astype(scale_dtype).reshape(-1)
    inits = [numpy_helper.from_array(blob, name + "_q"), numpy_helper.from_array(sc, name + "_scales")]
    node = helper.make_node(OP_TYPE, [a, name + "_q", name + "_scales"], [out], name=name, domain=PF_DOMAIN,
                            K=K, N=N, block_size=block, weight_dtype=W_dtype, act_dtype=act_dtype)
    return node, inits


def _shape_error(node, consts, msg):
    shapes = [tuple(consts[n].shape) if n in consts else None for n in node.input]
    return NodeError(node.name, node.op_type, 1, shapes, msg)


def lowbit_weight(node, consts: dict) -> QuantizedWeight:
    """MatMulLowBit's B and scales -> QuantizedWeight [N, K] (scales fp16, e8m0 for mxfp4);
    NodeError naming the input or attribute that does not fit."""
    try:
        return _decode_weight(node, consts)
    except ValueError as e:
        raise ValueError(str(e)) from None


def lowbit_problem(node, consts: dict) -> str | None:
    """Why this MatMulLowBit's attributes and constants do not fit together (None if they do)."""
    try:
        _decode_weight(node, consts)
    except ValueError as e:
        return str(e)
    return None


def _decode_weight(node, consts: dict) -> QuantizedWeight:
    at = _attrs(node)
    missing = [k for k in ("K", "N", "block_size", "weight_dtype") if k not in at]
    if missing:
        raise ValueError(f"attributes {missing} are required")
    K, N, bs, wd = at["K"], at["N"], at["block_size"], at["weight_dtype"]
    act = at.get("act_dtype", "")
    if min(K, N) < 1:
        raise ValueError(f"K and N must be positive, got K={K}, N={N}")
    if check_lowbit_args(wd, bs, act) != bs:
        raise ValueError(f"block_size {bs} does not fit {wd}")
    names = list(node.input) + [""] * 4
    if any(n not in consts for n in names[1:3]) or (names[3] and names[3] not in consts):
        raise ValueError("B, scales (and bias) must be constants")
    tt = get_ttype(wd)
    blocks = -(-K // bs)
    b, s = consts[names[1]], consts[names[2]]
    want_b, want_s = N * blocks * (bs * tt.bits // 8), N * blocks
    if b.dtype != np.uint8 or b.size != want_b:
        raise ValueError(f"input 1 ('{names[1]}') must be uint8 with {want_b} elements "
                         f"(K={K}, N={N}, {wd}, block_size={bs}); it is {b.dtype} with {b.size}")
    want_sdt = "uint8" if tt.kind == "block" else "a float type"
    if s.size != want_s or (tt.kind == "block") != (s.dtype == np.uint8) or \
            (tt.kind != "block" and s.dtype.kind != "f"):
        raise ValueError(f"input 2 ('{names[2]}') must hold {want_s} scales of {want_sdt}; "
                         f"it is {s.dtype} with {s.size}")
    if names[3] and consts[names[3]].size != N:
        raise ValueError(f"bias ('{names[3]}') must have N={N} elements")
    codes = unpack_bits(b.reshape(N, blocks, -1), tt.bits, bs).reshape(N, -1)[:, :K]
    scale = s.reshape(N, blocks)
    scale = scale if tt.kind == "block" else scale.astype(np.float16)
    return QuantizedWeight(wd, codes, scale, None, bs if bs < K or tt.kind == "block" else K, None)


def matmul_lowbit_reference(node, inputs: list) -> np.ndarray:
    """numpy MatMulLowBit in float64, cast to A's dtype (docs/ttile.md gives the definition)."""
    at = _attrs(node)
    consts = {n: np.asarray(v) for n, v in zip(node.input, inputs) if n and v is not None}
    qw = lowbit_weight(node, {n: consts[n] for n in node.input[1:] if n})
    tt = get_ttype(qw.wtype)
    K = at["K"]
    if tt.kind == "block":
        vals = get_ttype(tt.element).decode(qw.codes)
        scale = e8m0_decode(qw.scale)
    else:
        vals = tt.decode(qw.codes)
        scale = np.asarray(inputs[2]).astype(np.float64).reshape(qw.scale.shape)
    w = vals.astype(np.float64) * np.repeat(scale, at["block_size"], axis=1)[:, :K]
    A = np.asarray(inputs[0])
    a64 = A.astype(np.float64)
    if at.get("act_dtype", "") == "int8":
        q, s = quantize_rows_int8(a64)
        y = (q @ w.T) * s
    else:
        y = a64 @ w.T
    if len(inputs) > 3 and inputs[3] is not None:
        y = y + np.asarray(inputs[3]).astype(np.float64)
    return y.astype(A.dtype)


def matmul_lowbit_to_typed(node, consts: dict, M: int, A_dtype: str = "fp16", out_dtype: str | None = None):
    """(Matmul-like, PackedWeight) for a MatMulLowBit node with M rows of A_dtype activations.
    act_dtype int8: an Int8ActMatmul, which rounds the activations on the device first."""
    from .matmul import Matmul
    at = _attrs(node)
    qw = lowbit_weight(node, consts)
    bias_name = node.input[3] if len(node.input) > 3 else ""
    bias = consts.get(bias_name) if bias_name else None
    N, K = qw.codes.shape
    group = None if qw.group_size >= K else qw.group_size
    int8 = at.get("act_dtype", "") == "int8"
    try:
        if int8:
            from .act_int8 import Int8ActMatmul
            mm = Int8ActMatmul(M, N, K, A_dtype, qw.wtype, out_dtype or A_dtype, group, bias is not None)
        else:
            mm = Matmul(M, N, K, A_dtype, qw.wtype, out_dtype=out_dtype, group_size=group,
                        with_bias=bias is not None)
    except ValueError as e:
        raise _shape_error(node, consts, f"no typed GEMM for this weight: {e}") from None
    return mm, mm.pack(qw, bias=bias)


# ---- the model rewrite -------------------------------------------------------------------

def quantize_model_lowbit(model: onnx.ModelProto, W_dtype: str, group_size: int | None = 128,
                          act_dtype: str = "") -> onnx.ModelProto:
    """Every MatMul(A, B) with B a constant 2-D float [K, N] -> MatMulLowBit; other nodes unchanged.
    An initializer used only by rewritten MatMuls is dropped."""
    block = check_lowbit_args(W_dtype, group_size, act_dtype)
    model, inits, users = copy_with_uses(model)
    g = model.graph
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    nodes, rewritten = [], {}
    typed = {v.name for v in list(g.input) + list(g.value_info)} | set(inits)
    for node in g.node:
        b = inits.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") \
            and len(node.input) == 2 else None
        if b is None or len(b.dims) != 2 or b.data_type not in floats:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(b).astype(np.float32)
        sdt = onnx.helper.tensor_dtype_to_np_dtype(b.data_type)
        sdt = np.float32 if sdt.name == "bfloat16" else sdt
        name = _unique(node.name or node.output[0], inits)
        new, extra = lowbit_node(name, node.input[0], node.output[0], w, W_dtype, block, act_dtype, sdt)
        g.initializer.extend(extra)
        inits.update({t.name: t for t in extra})
        nodes.append(new)
        rewritten[b.name] = rewritten.get(b.name, 0) + 1
        if node.input[0] not in typed:   # A's type stated for shape inference (scales may not say it)
            g.value_info.append(helper.make_tensor_value_info(node.input[0], b.data_type, None))
            typed.add(node.input[0])
    del g.node[:]
    g.node.extend(nodes)
    kept = [t for t in g.initializer if rewritten.get(t.name, 0) != users.get(t.name, -1)]
    del g.initializer[:]
    g.initializer.extend(kept)
    if not any(o.domain == PF_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PF_DOMAIN, 1))
    return model


def node_quantized_weight(node, consts: dict) -> QuantizedWeight:
    """The QuantizedWeight [N, K] that a MatMulNBits or MatMulLowBit node holds: `quant.dequantize`
    of it is the weight a reference computes with (the LLM decode benchmark checks against it)."""
    if node.op_type == "MatMulNBits":
        return _nbits_weight(node, consts)[0]
    if node.op_type == "MatMulLowBit":
        return lowbit_weight(node, consts)
    raise ValueError(f"node '{node.name}' is a {node.op_type}, not MatMulNBits or MatMulLowBit")
