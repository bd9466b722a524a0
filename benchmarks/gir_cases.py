"""Benchmark cases for memory-bound work, each as an ONNX model (what PowerFusion compiles)
and the same computation in torch (what the baselines run).

Sizes are those of the named models at realistic batch sizes, so every case moves far
more than L2: the subgraphs are cut from BERT-base, GPT-2 (prefill; decode attention with
a KV cache of 1K-32K), ViT-B/16, ShuffleNetV2, EfficientNet-B0, SAR-DRN and RedNet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
EPS = 1e-5
DT = {"float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}


@dataclass
class BenchCase:
    suite: str
    name: str
    dtype: str
    model: onnx.ModelProto
    inputs: dict[str, tuple[tuple[int, ...], str]]   # name -> (shape, "normal" | "bool" | "positive")
    torch_fn: Callable                               # (*inputs in model input order) -> output(s)
    bytes: int                                       # compulsory bytes: inputs + outputs (+ weights)


class G:
    """A tiny graph builder over onnx.helper."""
    def __init__(self, dtype: str):
        self.dtype, self.nodes, self.inits, self.inputs, self.outputs, self.k = dtype, [], [], [], [], 0

    def inp(self, name, shape, dtype=None):
        self.inputs.append(helper.make_tensor_value_info(name, DT.get(dtype or self.dtype, dtype), list(shape)))
        return name

    def out(self, name, shape, dtype=None):
        self.outputs.append(helper.make_tensor_value_info(name, DT.get(dtype or self.dtype, dtype), list(shape)))
        return name

    def const(self, value, dtype=None):
        self.k += 1
        name = f"c{self.k}"
        arr = np.asarray(value)
        if (dtype or self.dtype) == "bfloat16" and arr.dtype.kind == "f":
            t = helper.make_tensor(name, TensorProto.BFLOAT16, arr.shape, arr.astype(np.float32).ravel().tolist())
        elif arr.dtype.kind == "f":
            t = numpy_helper.from_array(arr.astype(np.float32 if (dtype or self.dtype) == "float32" else np.float16), name)
        else:
            t = numpy_helper.from_array(arr, name)
        self.inits.append(t)
        return name

    def op(self, op_type, inputs, out=None, **attrs):
        self.k += 1
        out = out or f"t{self.k}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out] if isinstance(out, str) else list(out),
                                           name=f"{op_type}_{self.k}", **attrs))
        return out

    def model(self, name, opset=OPSET) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="powerfusion-bench")
        m.ir_version = 8
        return m


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * (4 if dtype == "float32" else 2)


# ---- norms --------------------------------------------------------------------------------
def layernorm(m, n, dtype):
    import torch.nn.functional as F
    g = G(dtype)
    x, y = g.inp("x", (m, n)), g.out("y", (m, n))
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    g.op("LayerNormalization", [x, g.const(w), g.const(b)], y, axis=-1, epsilon=EPS)
    tw, tb = _torch_param(w, dtype), _torch_param(b, dtype)
    return BenchCase("norms", f"layernorm_{m}x{n}", dtype, g.model("layernorm"), {"x": ((m, n), "normal")},
                     lambda x: F.layer_norm(x, (n,), tw, tb, EPS), 2 * _nbytes((m, n), dtype) + 2 * _nbytes((n,), dtype))


def rmsnorm(m, n, dtype):
    import torch
    g = G(dtype)
    x, y = g.inp("x", (m, n)), g.out("y", (m, n))
    w = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    sq = g.op("Mul", [x, x])
    ms = g.op("ReduceMean", [sq], axes=[-1], keepdims=1)
    rs = g.op("Sqrt", [g.op("Add", [ms, g.const(np.array(EPS, np.float32))])])
    g.op("Mul", [g.op("Div", [x, rs]), g.const(w)], y)
    tw = _torch_param(w, dtype)

    def fn(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * tw
    return BenchCase("norms", f"rmsnorm_{m}x{n}", dtype, g.model("rmsnorm"), {"x": ((m, n), "normal")}, fn,
                     2 * _nbytes((m, n), dtype) + _nbytes((n,), dtype))


def softmax(m, n, dtype):
    import torch
    g = G(dtype)
    x, y = g.inp("x", (m, n)), g.out("y", (m, n))
    g.op("Softmax", [x], y, axis=-1)
    return BenchCase("norms", f"softmax_{m}x{n}", dtype, g.model("softmax"), {"x": ((m, n), "normal")},
                     lambda x: torch.softmax(x, -1), 2 * _nbytes((m, n), dtype))


def _torch_param(a, dtype):
    import torch
    return torch.tensor(a, device=_device(), dtype=getattr(torch, dtype))


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- subgraphs cut from models --------------------------------------------------------------
def add_layernorm(suite, m, n, dtype="float32"):
    import torch.nn.functional as F
    g = G(dtype)
    x, r, y = g.inp("x", (m, n)), g.inp("r", (m, n)), g.out("y", (m, n))
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    g.op("LayerNormalization", [g.op("Add", [x, r]), g.const(w), g.const(b)], y, axis=-1, epsilon=EPS)
    tw, tb = _torch_param(w, dtype), _torch_param(b, dtype)
    return BenchCase(suite, f"add_layernorm_{m}x{n}", dtype, g.model("add_ln"),
                     {"x": ((m, n), "normal"), "r": ((m, n), "normal")},
                     lambda x, r: F.layer_norm(x + r, (n,), tw, tb, EPS), 3 * _nbytes((m, n), dtype))


def bias_gelu(suite, m, n, approximate="none", dtype="float32"):
    import torch.nn.functional as F
    g = G(dtype)
    x, y = g.inp("x", (m, n)), g.out("y", (m, n))
    b = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    h = g.op("Add", [x, g.const(b)])
    if approximate == "none":
        e = g.op("Erf", [g.op("Div", [h, g.const(np.array(math.sqrt(2), np.float32))])])
        g.op("Mul", [g.op("Mul", [h, g.op("Add", [e, g.const(np.array(1, np.float32))])]),
                     g.const(np.array(0.5, np.float32))], y)
    else:
        c = g.op("Mul", [g.op("Add", [h, g.op("Mul", [g.op("Pow", [h, g.const(np.array(3, np.float32))]),
                                                       g.const(np.array(0.044715, np.float32))])]),
                         g.const(np.array(math.sqrt(2 / math.pi), np.float32))])
        g.op("Mul", [g.op("Mul", [h, g.const(np.array(0.5, np.float32))]),
                     g.op("Add", [g.op("Tanh", [c]), g.const(np.array(1, np.float32))])], y)
    tb = _torch_param(b, dtype)
    return BenchCase(suite, f"bias_gelu_{approximate}_{m}x{n}", dtype, g.model("bias_gelu"), {"x": ((m, n), "normal")},
                     lambda x: F.gelu(x + tb, approximate=approximate), 2 * _nbytes((m, n), dtype))


def scale_mask_softmax(suite, b, h, s, causal=False, dtype="float32"):
    import torch
    g = G(dtype)
    x, y = g.inp("s", (b, h, s, s)), g.out("y", (b, h, s, s))
    scaled = g.op("Mul", [x, g.const(np.array(0.125, np.float32))])
    if causal:
        tri = np.tril(np.ones((s, s), bool))
        masked = g.op("Where", [g.const(tri), scaled, g.const(np.array(-1e4, np.float32))])
        inputs = {"s": ((b, h, s, s), "normal")}
        ttri = torch.tensor(tri, device=_device())
        fn = lambda x: torch.softmax(torch.where(ttri, x * 0.125, -1e4), -1)  # noqa: E731
        extra = 0
    else:
        mask = g.inp("mask", (b, 1, 1, s))
        masked = g.op("Add", [scaled, mask])
        inputs = {"s": ((b, h, s, s), "normal"), "mask": ((b, 1, 1, s), "normal")}
        fn = lambda x, m: torch.softmax(x * 0.125 + m, -1)  # noqa: E731
        extra = _nbytes((b, s), dtype)
    g.op("Softmax", [masked], y, axis=-1)
    return BenchCase(suite, f"scale_{'causal' if causal else 'mask'}_softmax_{b}x{h}x{s}x{s}", dtype,
                     g.model("softmax"), inputs, fn, 2 * _nbytes((b, h, s, s), dtype) + extra)


def decode_attention(suite, b, h, t, d=64, dtype="float32"):
    """GPT-2 decode step attention over a KV cache: q.K^T (GEMV), scale, softmax, .V (GEMV),
    heads back to [b, 1, h*d]."""
    g = G(dtype)
    q, k, v = g.inp("q", (b, h, 1, d)), g.inp("k", (b, h, t, d)), g.inp("v", (b, h, t, d))
    y = g.out("y", (b, 1, h * d))
    sc = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                      g.const(np.array(1 / math.sqrt(d), np.float32))])
    o = g.op("MatMul", [g.op("Softmax", [sc], axis=-1), v])
    g.op("Reshape", [g.op("Transpose", [o], perm=[0, 2, 1, 3]), g.const(np.array([b, 1, h * d], np.int64))], y)

    def fn(q, k, v):
        import torch   # the reference only: building the case needs no torch (CPU tests)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
        return (p @ v).transpose(1, 2).reshape(b, 1, h * d)
    return BenchCase(suite, f"decode_attention_b{b}_h{h}_t{t}", dtype, g.model("decode_attn"),
                     {"q": ((b, h, 1, d), "normal"), "k": ((b, h, t, d), "normal"), "v": ((b, h, t, d), "normal")},
                     fn, 2 * _nbytes((b, h, t, d), dtype) + 2 * _nbytes((b, h, d), dtype))


def decode_attention_gqa(suite, b, h, hkv, t, d=128, dtype="float32"):
    """A LLaMA-style decode step with grouped-query attention: h query heads, hkv KV heads, each
    KV head read by g = h / hkv query heads. The query is stored grouped by KV head,
    [b, hkv, g, d] (the same memory as [b, h, 1, d]), so each group is one [g, t] product against
    its KV head, as grouped-query decode kernels compute it (no repeat of K and V)."""
    g_ = G(dtype)
    grp = h // hkv
    q, k, v = g_.inp("q", (b, hkv, grp, d)), g_.inp("k", (b, hkv, t, d)), g_.inp("v", (b, hkv, t, d))
    y = g_.out("y", (b, 1, h * d))
    sc = g_.op("Mul", [g_.op("MatMul", [q, g_.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                       g_.const(np.array(1 / math.sqrt(d), np.float32))])
    o = g_.op("MatMul", [g_.op("Softmax", [sc], axis=-1), v])
    g_.op("Reshape", [o, g_.const(np.array([b, 1, h * d], np.int64))], y)

    def fn(q, k, v):
        import torch   # the reference only: building the case needs no torch (CPU tests)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
        return (p @ v).reshape(b, 1, h * d)
    return BenchCase(suite, f"decode_attention_gqa_b{b}_h{h}_kv{hkv}_t{t}", dtype, g_.model("decode_attn_gqa"),
                     {"q": ((b, hkv, grp, d), "normal"), "k": ((b, hkv, t, d), "normal"),
                      "v": ((b, hkv, t, d), "normal")},
                     fn, 2 * _nbytes((b, hkv, t, d), dtype) + 2 * _nbytes((b, h, d), dtype))


def decode_cases(kv_lens=(1024, 4096, 16384, 32768), dtypes=("float32", "bfloat16")):
    """Decode attention over a KV cache of 1K-32K: GPT-2 (MHA, 12 heads of 64, batch 4; the
    subgraph suite's rows) and LLaMA-style GQA (32 query heads over 8 KV heads of 128, batch 4);
    fp32 rows first."""
    s = "decode"
    out = []
    for dt in dtypes:
        out += [decode_attention(s + "/gpt2", 4, 12, t, dtype=dt) for t in kv_lens]
        out += [decode_attention_gqa(s + "/llama", 4, 32, 8, t, dtype=dt) for t in kv_lens]
    return out


def channel_shuffle(suite, n, c, hw, dtype="float32"):
    import torch
    g = G(dtype)
    a, b = g.inp("a", (n, c, hw, hw)), g.inp("b", (n, c, hw, hw))
    y1, y2 = g.out("y1", (n, c, hw, hw)), g.out("y2", (n, c, hw, hw))
    cat = g.op("Concat", [a, b], axis=1)
    r = g.op("Reshape", [cat, g.const(np.array([n, 2, c, hw, hw], np.int64))])
    tr = g.op("Transpose", [r], perm=[0, 2, 1, 3, 4])
    r2 = g.op("Reshape", [tr, g.const(np.array([n, 2 * c, hw, hw], np.int64))])
    g.op("Split", [r2, g.const(np.array([c, c], np.int64))], [y1, y2], axis=1)

    def fn(a, b):
        x = torch.cat([a, b], 1).view(n, 2, c, hw, hw).transpose(1, 2).reshape(n, 2 * c, hw, hw)
        return x[:, :c].contiguous(), x[:, c:].contiguous()
    return BenchCase(suite, f"channel_shuffle_{n}x{2 * c}x{hw}x{hw}", dtype, g.model("shuffle"),
                     {"a": ((n, c, hw, hw), "normal"), "b": ((n, c, hw, hw), "normal")}, fn,
                     4 * _nbytes((n, c, hw, hw), dtype))


def _bn_params(c, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32),
            rng.standard_normal(c).astype(np.float32), (rng.random(c) + 0.5).astype(np.float32))


def dwconv_bn_silu(suite, n, c, hw, dtype="float32"):
    import torch
    import torch.nn.functional as F
    g = G(dtype)
    x, y = g.inp("x", (n, c, hw, hw)), g.out("y", (n, c, hw, hw))
    w = (np.random.default_rng(4).standard_normal((c, 1, 3, 3)) / 3).astype(np.float32)
    sc, bi, mu, var = _bn_params(c, 5)
    conv = g.op("Conv", [x, g.const(w)], group=c, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    bn = g.op("BatchNormalization", [conv, g.const(sc), g.const(bi), g.const(mu), g.const(var)], epsilon=EPS)
    g.op("Mul", [bn, g.op("Sigmoid", [bn])], y)
    tw, ts, tb, tm, tv = (_torch_param(a, dtype) for a in (w, sc, bi, mu, var))

    def fn(x):
        return F.silu(F.batch_norm(F.conv2d(x, tw, None, 1, 1, 1, c), tm, tv, ts, tb, False, 0.0, EPS))
    # ONNX Conv takes bfloat16 from opset 22
    return BenchCase(suite, f"dwconv3x3_bn_silu_{n}x{c}x{hw}x{hw}", dtype,
                     g.model("dwconv", opset=22 if dtype == "bfloat16" else OPSET),
                     {"x": ((n, c, hw, hw), "normal")}, fn, 2 * _nbytes((n, c, hw, hw), dtype))


def dwconv_bias(suite, n, c, hw, k=7, dtype="float32"):
    """ConvNeXt's depthwise k x k conv (padding k // 2, with its bias), alone."""
    import torch.nn.functional as F
    g = G(dtype)
    x, y = g.inp("x", (n, c, hw, hw)), g.out("y", (n, c, hw, hw))
    w = (np.random.default_rng(6).standard_normal((c, 1, k, k)) / k).astype(np.float32)
    b = np.random.default_rng(7).standard_normal(c).astype(np.float32)
    g.op("Conv", [x, g.const(w), g.const(b)], y, group=c, kernel_shape=[k, k], pads=[k // 2] * 4)
    tw, tb = _torch_param(w, dtype), _torch_param(b, dtype)

    def fn(x):
        return F.conv2d(x, tw, tb, 1, k // 2, 1, c)
    return BenchCase(suite, f"dwconv{k}x{k}_bias_{n}x{c}x{hw}x{hw}", dtype, g.model("dwconv_bias"),
                     {"x": ((n, c, hw, hw), "normal")}, fn, 2 * _nbytes((n, c, hw, hw), dtype))


def se_scale(suite, n, c, hw, dtype="float32"):
    import torch
    g = G(dtype)
    x, s, y = g.inp("x", (n, c, hw, hw)), g.inp("s", (n, c, 1, 1)), g.out("y", (n, c, hw, hw))
    g.op("Mul", [x, g.op("Sigmoid", [s])], y)
    return BenchCase(suite, f"se_scale_{n}x{c}x{hw}x{hw}", dtype, g.model("se"),
                     {"x": ((n, c, hw, hw), "normal"), "s": ((n, c, 1, 1), "normal")},
                     lambda x, s: x * torch.sigmoid(s), 2 * _nbytes((n, c, hw, hw), dtype))


def bn_relu_add(suite, n, c, hw, dtype="float32"):
    import torch.nn.functional as F
    g = G(dtype)
    x, r, y = g.inp("x", (n, c, hw, hw)), g.inp("r", (n, c, hw, hw)), g.out("y", (n, c, hw, hw))
    sc, bi, mu, var = _bn_params(c, 6)
    bn = g.op("BatchNormalization", [x, g.const(sc), g.const(bi), g.const(mu), g.const(var)], epsilon=EPS)
    g.op("Add", [g.op("Relu", [bn]), r], y)
    ts, tb, tm, tv = (_torch_param(a, dtype) for a in (sc, bi, mu, var))
    return BenchCase(suite, f"bn_relu_add_{n}x{c}x{hw}x{hw}", dtype, g.model("bn_relu_add"),
                     {"x": ((n, c, hw, hw), "normal"), "r": ((n, c, hw, hw), "normal")},
                     lambda x, r: F.relu(F.batch_norm(x, tm, tv, ts, tb, False, 0.0, EPS)) + r,
                     3 * _nbytes((n, c, hw, hw), dtype))


def involution(suite, n, c, hw, groups, k=3, dtype="float32", form="sum"):
    """RedNet's involution core: out[n,c,h,w] = sum_k kern[n, g(c), k, h, w] * xpad[n, c, h+kh, w+kw].
    form "sum": each tap a Slice times a Slice of the kernel, added up (a hand-written form);
    "stack": the taps stacked on a new axis, multiplied and summed over it -- what RedNet's
    torch code (models/rednet.py: torch.stack of the unfold taps) exports."""
    import torch
    import torch.nn.functional as F
    g = G(dtype)
    x, kern = g.inp("x", (n, c, hw, hw)), g.inp("kern", (n, groups, k * k, hw, hw))
    y = g.out("y", (n, c, hw, hw))
    p = k // 2
    xp = g.op("Pad", [x, g.const(np.array([0, 0, p, p, 0, 0, p, p], np.int64))])
    acc = None
    if form == "stack":
        taps = []
        for idx in range(k * k):
            kh, kw = divmod(idx, k)
            win = g.op("Slice", [xp, g.const(np.array([kh, kw], np.int64)),
                                 g.const(np.array([kh + hw, kw + hw], np.int64)), g.const(np.array([2, 3], np.int64))])
            taps.append(g.op("Unsqueeze", [win, g.const(np.array([2], np.int64))]))
        stack = g.op("Reshape", [g.op("Concat", taps, axis=2),
                                 g.const(np.array([n, groups, c // groups, k * k, hw * hw], np.int64))])
        weight = g.op("Reshape", [kern, g.const(np.array([n, groups, 1, k * k, hw * hw], np.int64))])
        acc = g.op("ReduceSum", [g.op("Mul", [weight, stack]), g.const(np.array([3], np.int64))], keepdims=0)
    for idx in range(k * k if form == "sum" else 0):
        kh, kw = divmod(idx, k)
        win = g.op("Slice", [xp, g.const(np.array([kh, kw], np.int64)), g.const(np.array([kh + hw, kw + hw], np.int64)),
                             g.const(np.array([2, 3], np.int64))])
        win = g.op("Reshape", [win, g.const(np.array([n, groups, c // groups, hw, hw], np.int64))])
        kk = g.op("Slice", [kern, g.const(np.array([idx], np.int64)), g.const(np.array([idx + 1], np.int64)),
                            g.const(np.array([2], np.int64))])
        term = g.op("Mul", [win, kk])
        acc = term if acc is None else g.op("Add", [acc, term])
    g.op("Reshape", [acc, g.const(np.array([n, c, hw, hw], np.int64))], y)

    def fn(x, kern):
        u = F.unfold(x, k, padding=p).view(n, groups, c // groups, k * k, hw, hw)
        return (kern.view(n, groups, 1, k * k, hw, hw) * u).sum(3).view(n, c, hw, hw)
    tag = "" if form == "sum" else f"_{form}"
    return BenchCase(suite, f"involution{tag}_{n}x{c}x{hw}x{hw}_g{groups}", dtype, g.model("involution"),
                     {"x": ((n, c, hw, hw), "normal"), "kern": ((n, groups, k * k, hw, hw), "normal")}, fn,
                     2 * _nbytes((n, c, hw, hw), dtype) + _nbytes((n, groups, k * k, hw, hw), dtype))


def rmsnorm_swiglu(suite, tokens, hidden, inter, dtype="float32"):
    """A LLaMA-style decoder's memory-bound work between its GEMMs: RMSNorm of the residual
    stream beside SwiGLU (silu(gate) * up) of the MLP's two projections -- two independent
    parts of one subgraph."""
    import torch
    g = G(dtype)
    x, gate, up = g.inp("x", (tokens, hidden)), g.inp("gate", (tokens, inter)), g.inp("up", (tokens, inter))
    y, a = g.out("y", (tokens, hidden)), g.out("a", (tokens, inter))
    w = np.random.default_rng(7).standard_normal(hidden).astype(np.float32)
    ms = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
    rs = g.op("Sqrt", [g.op("Add", [ms, g.const(np.array(EPS, np.float32))])])
    g.op("Mul", [g.op("Div", [x, rs]), g.const(w)], y)
    g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up], a)
    tw = _torch_param(w, dtype)

    def fn(x, gate, up):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * tw, torch.nn.functional.silu(gate) * up
    return BenchCase(suite, f"rmsnorm_swiglu_{tokens}x{hidden}_{inter}", dtype, g.model("rmsnorm_swiglu"),
                     {"x": ((tokens, hidden), "normal"), "gate": ((tokens, inter), "normal"),
                      "up": ((tokens, inter), "normal")}, fn,
                     2 * _nbytes((tokens, hidden), dtype) + 3 * _nbytes((tokens, inter), dtype) + _nbytes((hidden,), dtype))


def norm_cases(m=32768, ns=(256, 1024, 4096, 16384, 65536), dtypes=("float32", "bfloat16")):
    return [f(m, n, dt) for dt in dtypes for f in (layernorm, rmsnorm, softmax) for n in ns]


def subgraph_cases():
    s = "subgraphs"
    return [
        add_layernorm(s + "/bert", 32 * 128, 768), bias_gelu(s + "/bert", 32 * 128, 3072),
        scale_mask_softmax(s + "/bert", 32, 12, 128),
        bias_gelu(s + "/gpt2", 8 * 1024, 3072, "tanh"), scale_mask_softmax(s + "/gpt2", 8, 12, 512, causal=True),
        *[decode_attention(s + "/gpt2-decode", 4, 12, t) for t in (1024, 4096, 16384, 32768)],
        add_layernorm(s + "/vit", 64 * 197, 768), bias_gelu(s + "/vit", 64 * 197, 3072),
        channel_shuffle(s + "/shufflenet", 64, 116, 28),
        dwconv_bn_silu(s + "/efficientnet", 32, 144, 56), se_scale(s + "/efficientnet", 32, 144, 56),
        bn_relu_add(s + "/sardrn", 16, 64, 128),
        involution(s + "/rednet", 16, 64, 56, 4),   # form="stack" (the export's) imports to the same plan
    ]


def heldout_cases(batches=(1, 8), dtypes=("float32", "bfloat16")):
    """Subgraphs at shapes of models the plan search and its cost model were not tuned on,
    batch 1 and 8, fp32 and bf16: ShuffleNetV2 x1.0 stage 2 (116 channels at 28x28), GPT-2
    medium (hidden 1024, 16 heads, 1024 tokens per sequence), BERT-large at SQuAD length 384
    (16 heads, FFN 4096), a LLaMA-7B decode step (32 heads of 128 over a 1K KV cache),
    EfficientNet-B0 stage 5 (480 channels at 14x14, 3x3 depthwise) and TinyLlama (hidden 2048,
    MLP 5632) prefill of 256 tokens."""
    s = "heldout"
    out = []
    for dt in dtypes:
        for b in batches:
            out += [channel_shuffle(s + "/shufflenetv2", b, 58, 28, dt),
                    add_layernorm(s + "/gpt2-medium", b * 1024, 1024, dt),
                    scale_mask_softmax(s + "/bert-large", b, 16, 384, dtype=dt),
                    bias_gelu(s + "/bert-large", b * 384, 4096, dtype=dt),
                    decode_attention(s + "/llama-decode", b, 32, 1024, d=128, dtype=dt),
                    dwconv_bn_silu(s + "/efficientnet", b, 480, 14, dt),
                    rmsnorm_swiglu(s + "/tinyllama", b * 256, 2048, 5632, dt)]
    return out


def dwconv_cases():
    """Depthwise convs, the stencil template's rows: ConvNeXt-T's 7x7 (with bias) at its four
    stages, batch 1, fp32 and fp16; the held-out suite's EfficientNet-B0 3x3 + BN + SiLU (batch
    1 and 8, fp32 and bf16); the subgraph suite's EfficientNet 3x3 + BN + SiLU at batch 32."""
    s = "dwconv"
    out = []
    for dt, low in (("float32", "float32"), ("float16", "bfloat16")):   # fp32 rows first
        out += [dwconv_bias(s + "/convnext-t", 1, c, hw, 7, dt) for c, hw in ((96, 56), (192, 28), (384, 14), (768, 7))]
        out += [dwconv_bn_silu(s + "/efficientnet", b, 480, 14, low) for b in (1, 8)]
    return out + [dwconv_bn_silu(s + "/efficientnet", 32, 144, 56)]


SUITES = {"norms": norm_cases, "subgraphs": subgraph_cases, "heldout": heldout_cases, "dwconv": dwconv_cases,
          "decode": decode_cases}


def cases_for(suites) -> list[BenchCase]:
    """Every case of the named suites, in the order given (unknown names: an error)."""
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown benchmark suite(s) {unknown}; known: {sorted(SUITES)}")
    return [c for s in suites for c in SUITES[s]()]
