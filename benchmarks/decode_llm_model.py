"""A LLaMA-style decoder as one decode step, for the LLM decode benchmark (bench_decode_llm.py).

Built directly with onnx.helper from seeded numpy weights, so neither the benchmark nor its
tests need torch to export it. One step of `layers` decoder layers, per layer:

    h  = x + o_proj(attention(rope(q_proj(n)), cat(past_k, rope(k_proj(n))), cat(past_v, v_proj(n))))
    x' = h + down(silu(gate(m)) * up(m))          n = rmsnorm(x), m = rmsnorm(h)

with RMSNorm computed in float32 (as the reference LLaMA does), rotary embeddings applied to q
and k (cos / sin of the step's position are inputs, [B, 1, 1, D]), grouped-query attention
(`kv_heads` <= `heads`; LLaMA-7B is 32 of 32) over the KV cache plus the new token, and a final
RMSNorm. Inputs: x [B, 1, hidden], cos, sin, past_k_i / past_v_i [B, kv_heads, T, D]. Outputs:
y [B, 1, hidden] and each layer's new key / value [B, kv_heads, 1, D] (the caller appends them to
its cache in place; returning the whole concatenated cache would add a copy that serving
runtimes do not make). Every projection is a MatMul with a constant 2-D [K, N] weight, which
`powerfusion quantize-weights` rewrites. No embedding or LM head: the benchmark is the layers.

`numpy_decode_step` is the same step in float64 numpy (the CPU test's second reference beside
onnxruntime) and `torch_decode_module` the same step as a torch module (the device baselines).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper, numpy_helper

EPS = 1e-5
ROPE_BASE = 10000.0
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32
    kv_heads: int = 32
    layers: int = 2
    batch: int = 1
    past: int = 1024

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    def weight_shapes(self) -> dict[str, tuple[int, int]]:
        h, kv = self.hidden, self.kv_heads * self.head_size
        return {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h),
                "gate": (h, self.intermediate), "up": (h, self.intermediate), "down": (self.intermediate, h)}


def make_weights(cfg: DecoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded fp16 weights: projections ~ N(0, 1/K) (activations stay O(1) through the layers),
    norm gains ~ 1 + N(0, 0.1^2). Names: "l{i}.{proj}", "l{i}.norm1|norm2", "final_norm"."""
    rng = np.random.default_rng(seed)
    w = {}
    for i in range(cfg.layers):
        for p, (k, n) in cfg.weight_shapes().items():
            w[f"l{i}.{p}"] = (rng.standard_normal((k, n), dtype=np.float32) / math.sqrt(k)).astype(np.float16)
        for p in ("norm1", "norm2"):
            w[f"l{i}.{p}"] = (1 + 0.1 * rng.standard_normal(cfg.hidden, dtype=np.float32)).astype(np.float16)
    w["final_norm"] = (1 + 0.1 * rng.standard_normal(cfg.hidden, dtype=np.float32)).astype(np.float16)
    return w


def make_inputs(cfg: DecoderConfig, seed: int = 1) -> dict[str, np.ndarray]:
    """The step's inputs: x ~ N(0, 1), the cache ~ N(0, 1), cos / sin at position `past`."""
    rng = np.random.default_rng(seed)
    B, D = cfg.batch, cfg.head_size
    cos, sin = rope_tables(cfg.past, D)
    feeds = {"x": rng.standard_normal((B, 1, cfg.hidden), dtype=np.float32).astype(np.float16),
             "cos": np.broadcast_to(cos, (B, 1, 1, D)).astype(np.float16),
             "sin": np.broadcast_to(sin, (B, 1, 1, D)).astype(np.float16)}
    for i in range(cfg.layers):
        for kv in ("k", "v"):
            feeds[f"past_{kv}{i}"] = rng.standard_normal((B, cfg.kv_heads, cfg.past, D),
                                                         dtype=np.float32).astype(np.float16)
    return feeds


def rope_tables(position: int, head_size: int) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [head_size] of one position, halves repeated (the rotate-half convention)."""
    inv = ROPE_BASE ** (-np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    ang = np.concatenate([position * inv, position * inv])
    return np.cos(ang), np.sin(ang)


class _Graph:
    """Nodes, initializers and fresh names for one onnx.helper graph."""
    def __init__(self):
        self.nodes, self.inits, self.k = [], [], 0

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs, out: str | None = None, **attrs) -> str:
        self.k += 1
        out = out or f"t{self.k}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{op_type}_{self.k}", **attrs))
        return out


def _rmsnorm(g: _Graph, x: str, gain: str, out: str | None = None) -> str:
    """RMSNorm in float32, cast back to fp16 before the gain (LLaMA's order)."""
    xf = g.op("Cast", [x], to=TensorProto.FLOAT)
    ms = g.op("ReduceMean", [g.op("Mul", [xf, xf])], axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, "eps"])])])
    return g.op("Mul", [g.op("Cast", [g.op("Mul", [xf, inv])], to=TensorProto.FLOAT16), gain], out)


def _heads(g: _Graph, t: str, cfg: DecoderConfig, n: int) -> str:
    """[B, 1, n*D] -> [B, n, 1, D] (Reshape's 0 keeps the batch: with_batch changes it)."""
    shape = g.const(f"shape_h{n}_{g.k}", np.array([0, 1, n, cfg.head_size], np.int64))
    return g.op("Transpose", [g.op("Reshape", [t, shape])], perm=[0, 2, 1, 3])


def _rope(g: _Graph, t: str) -> str:
    """t * cos + rotate_half(t) * sin, rotate_half(t) = cat(-t[D/2:], t[:D/2])."""
    lo = g.op("Slice", [t, "zero", "half", "axes_last"])
    hi = g.op("Slice", [t, "half", "big", "axes_last"])
    rot = g.op("Concat", [g.op("Neg", [hi]), lo], axis=-1)
    return g.op("Add", [g.op("Mul", [t, "cos"]), g.op("Mul", [rot, "sin"])])


def _attention(g: _Graph, cfg: DecoderConfig, i: int, q: str, k: str, v: str) -> str:
    """Grouped-query attention of one token over cat(past, new): q grouped [B, Hkv, G, D]
    (the same memory as [B, H, 1, D]); output [B, 1, hidden]."""
    Hkv, G, D = cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_size
    keys = g.op("Concat", [f"past_k{i}", k], axis=2)
    vals = g.op("Concat", [f"past_v{i}", v], axis=2)
    qg = g.op("Reshape", [q, g.const(f"shape_qg{i}", np.array([0, Hkv, G, D], np.int64))])
    s = g.op("Mul", [g.op("MatMul", [qg, g.op("Transpose", [keys], perm=[0, 1, 3, 2])]), "scale"])
    o = g.op("MatMul", [g.op("Softmax", [s], axis=-1), vals])
    return g.op("Reshape", [o, g.const(f"shape_o{i}", np.array([0, 1, cfg.hidden], np.int64))])


def _layer(g: _Graph, cfg: DecoderConfig, i: int, x: str) -> str:
    n = _rmsnorm(g, x, f"l{i}.norm1")
    q = _rope(g, _heads(g, g.op("MatMul", [n, f"l{i}.q"]), cfg, cfg.heads))
    k = g.op("Identity", [_rope(g, _heads(g, g.op("MatMul", [n, f"l{i}.k"]), cfg, cfg.kv_heads))], f"new_k{i}")
    v = g.op("Identity", [_heads(g, g.op("MatMul", [n, f"l{i}.v"]), cfg, cfg.kv_heads)], f"new_v{i}")
    h = g.op("Add", [x, g.op("MatMul", [_attention(g, cfg, i, q, k, v), f"l{i}.o"])])
    m = _rmsnorm(g, h, f"l{i}.norm2")
    gate = g.op("MatMul", [m, f"l{i}.gate"])
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), g.op("MatMul", [m, f"l{i}.up"])])
    return g.op("Add", [h, g.op("MatMul", [act, f"l{i}.down"])])


def build_decoder_onnx(cfg: DecoderConfig, weights: dict[str, np.ndarray]):
    """The decode step as an fp16 ONNX model (opset 17) holding `weights` as initializers."""
    g = _Graph()
    B, D, f16 = cfg.batch, cfg.head_size, TensorProto.FLOAT16
    for name, value in weights.items():
        g.const(name, value)
    g.const("eps", np.array(EPS, np.float32))
    g.const("axes_last", np.array([-1], np.int64))
    g.const("zero", np.array([0], np.int64))
    g.const("half", np.array([D // 2], np.int64))
    g.const("big", np.array([D], np.int64))
    g.const("scale", np.array(1 / math.sqrt(D), np.float16))
    x = "x"
    for i in range(cfg.layers):
        x = _layer(g, cfg, i, x)
    _rmsnorm(g, x, "final_norm", "y")
    kv = [B, cfg.kv_heads, cfg.past, D]
    inputs = [helper.make_tensor_value_info("x", f16, [B, 1, cfg.hidden]),
              helper.make_tensor_value_info("cos", f16, [B, 1, 1, D]),
              helper.make_tensor_value_info("sin", f16, [B, 1, 1, D])]
    inputs += [helper.make_tensor_value_info(f"past_{c}{i}", f16, kv) for i in range(cfg.layers) for c in "kv"]
    outputs = [helper.make_tensor_value_info("y", f16, [B, 1, cfg.hidden])]
    outputs += [helper.make_tensor_value_info(f"new_{c}{i}", f16, [B, cfg.kv_heads, 1, D])
                for i in range(cfg.layers) for c in "kv"]
    graph = helper.make_graph(g.nodes, "llama_decode_step", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="powerfusion-bench")
    model.ir_version = 8
    return model


def with_batch(model, batch: int):
    """The model with batch `batch` in its declared input and output shapes, in place (its
    Reshapes copy the batch from their input, so nothing else holds it); returns the model."""
    for vi in [*model.graph.input, *model.graph.output]:
        vi.type.tensor_type.shape.dim[0].dim_value = batch
    return model


def quantize_decoder(model, dtype: str, act: str | None = None, processes: int = 1):
    """`powerfusion quantize-weights` (its function, quantize_weights_model) applied to each
    weight MatMul alone, `processes` at a time, the results spliced back in node order: the same
    model as one call on the whole model (tests check it), in a fraction of the time at 7B
    widths, where numpy quantises one MatMul per core. Returns (model, op type written,
    {weight name: the fp16 rounding of what its quantised node holds}), the last being the
    weights a reference computes with."""
    import multiprocessing as mp

    inits = {t.name: t for t in model.graph.initializer}
    jobs = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    global _QUANT_JOB
    _QUANT_JOB = (model, inits, dtype, act)
    if processes > 1:
        with mp.get_context("fork").Pool(min(processes, len(jobs))) as pool:
            done = pool.map(_quantize_one, [n.name for n in jobs])
    else:
        done = [_quantize_one(n.name) for n in jobs]
    _QUANT_JOB = None
    dequantised = {n.input[1]: d[4] for n, d in zip(jobs, done)}
    return _splice(model, dict(zip((n.name for n in jobs), done))), done[0][2], dequantised


_QUANT_JOB = None


def _quantize_one(node_name: str):
    """(quantised node, its initializers, op type, opsets, dequantised fp16 weight [K, N]) for one
    weight MatMul of _QUANT_JOB's model."""
    from powerfusion.cli.cmd_quantize_weights import quantize_weights_model
    from powerfusion.ttile.onnx_lowbit import node_quantized_weight
    from powerfusion.ttile.quant import dequantize
    model, inits, dtype, act = _QUANT_JOB
    node = next(n for n in model.graph.node if n.name == node_name)
    w = inits[node.input[1]]
    vi = helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT16, None)
    vo = helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT16, None)
    one = helper.make_model(helper.make_graph([node], "one", [vi], [vo], [w]), opset_imports=model.opset_import)
    q, op = quantize_weights_model(one, dtype, None, act)
    qnode = q.graph.node[0]
    consts = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    deq = dequantize(node_quantized_weight(qnode, consts)).T.astype(np.float16)
    return qnode, list(q.graph.initializer), op, list(q.opset_import), deq


def _splice(model, done: dict):
    """The model with each quantised MatMul replaced by its node and initializers."""
    from onnx import ModelProto
    used = {n.input[1] for n in model.graph.node if n.name in done}
    out = ModelProto()
    out.CopyFrom(model)
    g = out.graph
    nodes = [done[n.name][0] if n.name in done else n for n in g.node]
    kept = [t for t in g.initializer if t.name not in used]
    del g.node[:], g.initializer[:]
    g.node.extend(nodes)
    g.initializer.extend(kept + [t for r in done.values() for t in r[1]])
    have = {o.domain for o in out.opset_import}
    out.opset_import.extend(o for o in next(iter(done.values()))[3] if o.domain not in have)
    return out


def numpy_decode_step(cfg: DecoderConfig, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray]):
    """The step in float64 numpy: (y, [new_k0, new_v0, ...])."""
    f = {k: np.asarray(v, np.float64) for k, v in feeds.items()}
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    B, H, Hkv, D = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_size

    def norm(t, gain):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * gain

    def rope(t):
        rot = np.concatenate([-t[..., D // 2:], t[..., :D // 2]], -1)
        return t * f["cos"] + rot * f["sin"]

    def heads(t, n):
        return t.reshape(B, 1, n, D).transpose(0, 2, 1, 3)

    x, new = f["x"], []
    for i in range(cfg.layers):
        n = norm(x, w[f"l{i}.norm1"])
        q, k = rope(heads(n @ w[f"l{i}.q"], H)), rope(heads(n @ w[f"l{i}.k"], Hkv))
        v = heads(n @ w[f"l{i}.v"], Hkv)
        new += [k, v]
        keys = np.concatenate([f[f"past_k{i}"], k], 2)
        vals = np.concatenate([f[f"past_v{i}"], v], 2)
        s = q.reshape(B, Hkv, H // Hkv, D) @ keys.transpose(0, 1, 3, 2) / math.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = ((p / p.sum(-1, keepdims=True)) @ vals).reshape(B, 1, cfg.hidden)
        h = x + o @ w[f"l{i}.o"]
        m = norm(h, w[f"l{i}.norm2"])
        gate = m @ w[f"l{i}.gate"]
        x = h + (gate / (1 + np.exp(-gate)) * (m @ w[f"l{i}.up"])) @ w[f"l{i}.down"]
    return norm(x, w["final_norm"]), new


def torch_decode_module(cfg: DecoderConfig, weights: dict[str, np.ndarray], device: str = "cuda"):
    """The step as a torch.nn.Module over the same fp16 weights: forward(x, cos, sin, *past)
    -> (y, new_k0, new_v0, ...), the ONNX model's outputs in order. Attention is written as the
    ONNX graph computes it (two matmuls and a softmax over cat(past, new)): torch.compile is
    free to fuse it; torch eager calls the kernels as written."""
    import torch

    B, H, Hkv, D = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_size

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, value in weights.items():
                self.register_buffer(name.replace(".", "_"), torch.from_numpy(value).to(device))

        def w(self, name):
            return getattr(self, name.replace(".", "_"))

        def norm(self, t, gain):
            tf = t.float()
            return (tf * torch.rsqrt((tf * tf).mean(-1, keepdim=True) + EPS)).half() * gain

        def forward(self, x, cos, sin, *past):
            def rope(t):
                return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

            def heads(t, n):
                return t.reshape(B, 1, n, D).transpose(1, 2)

            new = []
            for i in range(cfg.layers):
                n = self.norm(x, self.w(f"l{i}.norm1"))
                q, k = rope(heads(n @ self.w(f"l{i}.q"), H)), rope(heads(n @ self.w(f"l{i}.k"), Hkv))
                v = heads(n @ self.w(f"l{i}.v"), Hkv)
                new += [k, v]
                keys, vals = torch.cat([past[2 * i], k], 2), torch.cat([past[2 * i + 1], v], 2)
                s = (q.reshape(B, Hkv, H // Hkv, D) @ keys.transpose(-1, -2)) * (1 / math.sqrt(D))
                o = (torch.softmax(s, -1) @ vals).reshape(B, 1, cfg.hidden)
                h = x + o @ self.w(f"l{i}.o")
                m = self.norm(h, self.w(f"l{i}.norm2"))
                x = h + (torch.nn.functional.silu(m @ self.w(f"l{i}.gate")) * (m @ self.w(f"l{i}.up"))) \
                    @ self.w(f"l{i}.down")
            return (self.norm(x, self.w("final_norm")), *new)

    return Decoder().eval()
