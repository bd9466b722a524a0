"""ONNX side of typed GEMMs.

- `quantize_weights(model, W_dtype, group_size)`: rewrite MatMuls with a constant 2-D
  float weight into com.microsoft.MatMulNBits (the layout onnxruntime runs).
- `matmul_nbits_reference(node, inputs)`: numpy execution of MatMulNBits.
- `matmul_nbits_to_typed(node, consts, M, A_dtype)` and
  `dequantize_matmul_to_typed(dq_node, matmul_node, consts, M, A_dtype)`: the
  (Matmul, PackedWeight) a session runs for such a node / DequantizeLinear -> MatMul pair.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from powerfusion.errors import NodeError

from .matmul import Matmul, PackedWeight
from .quant import QuantizedWeight, pack_bits, quantize, unpack_bits

MS_DOMAIN = "com.microsoft"
NBITS_WTYPES = {"int2": 2, "int4": 4, "int8": 8, "uint2": 2, "uint4": 4, "uint8": 8}


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model: onnx.ModelProto, domain: str = "") -> int:
    return next((o.version for o in model.opset_import if o.domain == domain), 0)


def quantize_weights(model: onnx.ModelProto, W_dtype: str = "int4", group_size: int = 128) -> onnx.ModelProto:
    """MatMul(A, B const [K, N] float) -> MatMulNBits(A, B_q, scales[, zero_points]).
    Signed types are symmetric (MatMulNBits' default zero point 2**(bits-1) is our offset
    binary); unsigned ones carry uint8 zero points. Other MatMuls are left unchanged."""
    from powerfusion.ttile.dtype_names import canonical
    W_dtype = canonical(W_dtype)
    if W_dtype not in NBITS_WTYPES:
        raise ValueError(f"MatMulNBits holds {sorted(NBITS_WTYPES)}; got {W_dtype!r}")
    if group_size < 32 or group_size & (group_size - 1):   # MatMulNBits: >= 16; our kernels: >= 32
        raise ValueError(f"block_size must be a power of two >= 32, got {group_size}")
    bits = NBITS_WTYPES[W_dtype]
    model, inits, users = copy_with_uses(model)
    g = model.graph
    new_nodes, drop = [], set()
    for node in g.node:
        b = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if b is None or len(b.dims) != 2 or b.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(b).astype(np.float32)            # [K, N]
        K, N = w.shape
        zm = "quantized" if W_dtype.startswith("uint") else None
        qw = quantize(w.T, W_dtype, group_size if group_size < K else -1, zm)
        blocks = -(-K // group_size)
        codes = np.full((N, blocks * group_size), (1 << (bits - 1)) if zm is None else 0, np.uint8)
        codes[:, :K] = qw.codes
        if qw.group_size != group_size:                            # per channel -> one scale per block
            qw = QuantizedWeight(qw.wtype, qw.codes, np.repeat(qw.scale, blocks, 1),
                                 None if qw.zeros is None else np.repeat(qw.zeros, blocks, 1), group_size, zm)
        blob = pack_bits(codes.reshape(N, blocks, group_size), bits)  # LSB first, as MatMulNBits
        sdt = np.float16 if b.data_type == onnx.TensorProto.FLOAT16 else np.float32
        base = _unique(node.name or node.output[0], inits)
        ins = [node.input[0], base + "_q", base + "_scales"]
        extra = [numpy_helper.from_array(blob, base + "_q"),
                 numpy_helper.from_array(qw.scale.astype(sdt).reshape(-1), base + "_scales")]
        if zm:
            zp = pack_bits(qw.zeros.astype(np.uint8), bits)           # [N, ceil(blocks*bits/8)]
            ins.append(base + "_zp")
            extra.append(numpy_helper.from_array(zp.reshape(-1), base + "_zp"))
        g.initializer.extend(extra)
        for t in extra:
            inits[t.name] = t
        new_nodes.append(helper.make_node("MatMulNBits", ins, list(node.output), name=base,
                                          domain=MS_DOMAIN, K=K, N=N, bits=bits, block_size=group_size))
        if users.get(b.name, 0) == 1:
            drop.add(b.name)
    del g.node[:]
    g.node.extend(new_nodes)
    kept = [t for t in g.initializer if t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(kept)
    if not _opset(model, MS_DOMAIN):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return model


def copy_with_uses(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict, dict[str, int]]:
    """A copy of the model to rewrite, its initializers by name, and how many node inputs read
    each tensor (an initializer read only by rewritten nodes can be dropped)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    users: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            users[i] = users.get(i, 0) + 1
    return model, inits, users


def _unique(name: str, taken) -> str:
    base = "".join(c if c.isalnum() else "_" for c in name) or "matmul"
    out, i = base, 0
    while out + "_q" in taken:
        i += 1
        out = f"{base}_{i}"
    return out


def _nbits_weight(node, consts: dict) -> tuple[QuantizedWeight, str]:
    """MatMulNBits' B / scales / zero_points -> QuantizedWeight [N, K] and its W type."""
    at = _attrs(node)
    K, N, bits, bs = at["K"], at["N"], at.get("bits", 4), at["block_size"]
    names = list(node.input) + [""] * 6
    shapes = [tuple(consts[n].shape) if n in consts else None for n in node.input]
    if bits not in (2, 4, 8) or any(n and n not in consts for n in names[1:4]):
        raise NodeError(node.name, node.op_type, 1, shapes,
                        "needs bits in {2, 4, 8} and constant B / scales / zero_points")
    if names[4]:
        raise NodeError(node.name, node.op_type, 1, shapes, "g_idx (act-order) is not supported")
    blocks = -(-K // bs)
    zp = consts.get(names[3]) if names[3] else None
    want = {1: N * blocks * (bs * bits // 8), 2: N * blocks,
            3: N * blocks if zp is not None and zp.dtype != np.uint8 else N * -(-blocks * bits // 8)}
    for i in (1, 2, 3):
        if names[i] and consts[names[i]].size != want[i]:
            raise NodeError(node.name, node.op_type, 1, shapes, f"input {i} ('{names[i]}') has "
                            f"{consts[names[i]].size} elements; K={K}, N={N}, bits={bits}, "
                            f"block_size={bs} need {want[i]}")
    codes = unpack_bits(consts[names[1]].reshape(N, blocks, -1), bits, bs).reshape(N, -1)[:, :K]
    scale = consts[names[2]].astype(np.float32).reshape(N, blocks)
    if zp is None:
        return QuantizedWeight(f"int{bits}", codes, scale.astype(np.float16), None, bs, None), f"int{bits}"
    if zp.dtype == np.uint8:
        z = unpack_bits(zp.reshape(N, -1), bits, blocks)
        return QuantizedWeight(f"uint{bits}", codes, scale.astype(np.float16), z.astype(np.uint8), bs,
                               "quantized"), f"uint{bits}"
    return QuantizedWeight(f"uint{bits}", codes, scale.astype(np.float16),
                           zp.astype(np.float16).reshape(N, blocks), bs, "original"), f"uint{bits}"


def matmul_nbits_reference(node, inputs: list) -> np.ndarray:
    """numpy MatMulNBits: Y = A @ ((q - zp) * scale)^T (+ bias), in float64, cast to A's dtype."""
    at = _attrs(node)
    K, N, bits, bs = at["K"], at["N"], at.get("bits", 4), at["block_size"]
    A = np.asarray(inputs[0])
    ins = list(inputs) + [None] * 6
    blocks = -(-K // bs)
    q = unpack_bits(np.asarray(ins[1]).reshape(N, blocks, -1), bits, bs).astype(np.float64)   # [N, blocks, bs]
    scale = np.asarray(ins[2]).astype(np.float64).reshape(N, blocks, 1)
    zp = ins[3]
    if zp is None or (hasattr(zp, "size") and zp.size == 0):
        z = np.float64(1 << (bits - 1))
    elif np.asarray(zp).dtype == np.uint8:
        z = unpack_bits(np.asarray(zp).reshape(N, -1), bits, blocks).astype(np.float64).reshape(N, blocks, 1)
    else:
        z = np.asarray(zp).astype(np.float64).reshape(N, blocks, 1)
    w = ((q - z) * scale).reshape(N, -1)[:, :K]
    y = A.astype(np.float64) @ w.T
    if len(inputs) > 5 and inputs[5] is not None:
        y = y + np.asarray(inputs[5]).astype(np.float64)
    return y.astype(A.dtype)


def _typed(node, opset: int, shapes, qw: QuantizedWeight, M: int, A_dtype: str, out_dtype: str | None,
           group: int | None, bias=None) -> tuple[Matmul, PackedWeight]:
    N, K = qw.codes.shape
    try:
        mm = Matmul(M, N, K, A_dtype, qw.wtype, out_dtype=out_dtype, group_size=group,
                    zeros_mode=qw.zeros_mode, with_bias=bias is not None)
    except ValueError as e:   # e.g. a block size the kernels do not take (16, or not a power of two)
        raise NodeError(node.name, node.op_type, opset, shapes, f"no typed GEMM for this weight: {e}") from None
    return mm, mm.pack(qw, bias=bias)


def matmul_nbits_to_typed(node, consts: dict, M: int, A_dtype: str = "fp16",
                          out_dtype: str | None = None) -> tuple[Matmul, PackedWeight]:
    """The typed GEMM for a MatMulNBits node with M activation rows (scales become fp16);
    out_dtype: A_dtype (default) or fp32."""
    from powerfusion.ttile.dtype_names import canonical
    A_dtype, out_dtype = canonical(A_dtype), canonical(out_dtype)
    qw, _ = _nbits_weight(node, consts)
    bias_name = node.input[5] if len(node.input) > 5 else ""
    bias = consts.get(bias_name) if bias_name else None
    shapes = [tuple(consts[n].shape) if n in consts else None for n in node.input]
    return _typed(node, 1, shapes, qw, M, A_dtype, out_dtype, qw.group_size, bias)


def dequantize_matmul_to_typed(dq, matmul, consts: dict, M: int, A_dtype: str = "fp16",
                               out_dtype: str | None = None) -> tuple[Matmul, PackedWeight]:
    """DequantizeLinear(x [K, N] int4/uint4/int8/uint8 const) -> MatMul(A, .): the typed GEMM.
    Scales per output column (axis=1) or in blocks along K (axis=0, block_size attribute)."""
    from powerfusion.ttile.dtype_names import canonical
    A_dtype, out_dtype = canonical(A_dtype), canonical(out_dtype)
    x = consts.get(dq.input[0])
    s = consts.get(dq.input[1])
    z = consts.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    shapes = [None if x is None else x.shape, None if s is None else s.shape]
    if x is None or s is None or x.ndim != 2 or matmul.input[1] != dq.output[0]:
        raise NodeError(dq.name, dq.op_type, 21, shapes, "needs a constant 2-D x feeding MatMul's B")
    at = _attrs(dq)
    axis, bs = at.get("axis", 1) % 2, at.get("block_size", 0)
    K, N = x.shape
    signed = np.dtype(x.dtype).name in ("int8", "int4")
    bits = 4 if "4" in np.dtype(x.dtype).name else 8
    vals = x.astype(np.int64).T                                        # [N, K]
    if axis == 1 and s.ndim <= 1 and s.size in (1, N):                 # per output channel
        G, scale = K, np.broadcast_to(s.astype(np.float32).reshape(-1, 1), (N, 1))
        zz = None if z is None else np.broadcast_to(z.astype(np.int64).reshape(-1, 1), (N, 1))
    elif axis == 0 and bs and s.shape == (-(-K // bs), N):             # blocked along K
        G, scale = bs, s.astype(np.float32).T
        zz = None if z is None else z.astype(np.int64).T
    else:
        raise NodeError(dq.name, dq.op_type, 21, shapes, "scales must be per column (axis=1) or blocked along K (axis=0)")
    lo = -(1 << (bits - 1)) if signed else 0
    codes = (vals - lo).astype(np.uint8)
    if signed and (zz is None or not zz.any()):
        qw = QuantizedWeight(f"int{bits}", codes, scale.astype(np.float16), None, G, None)
    else:
        zc = (np.zeros((N, scale.shape[1]), np.int64) if zz is None else zz) - lo
        qw = QuantizedWeight(f"uint{bits}", codes, scale.astype(np.float16), zc.astype(np.uint8), G, "quantized")
    return _typed(dq, 21, shapes, qw, M, A_dtype, out_dtype, G if G < K else None)
