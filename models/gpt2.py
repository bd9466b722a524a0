"""GPT-2: a prefill graph (Hugging Face GPT2LMHeadModel) and one decode step with the KV
cache as graph inputs (a hand-written module that reuses the same weights)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .export import Recipe
from .onnx_tools import TensorSpec
from .weights import perturb_uniform_parameters

FULL = dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024, seq=128, past=128)
SMALL = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=128, seq=32, past=64)


def _hf_gpt2(small: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    p = {k: v for k, v in (SMALL if small else FULL).items() if k not in ("seq", "past")}
    cfg = GPT2Config(**p, bos_token_id=p["vocab_size"] - 1, eos_token_id=p["vocab_size"] - 1,
                     attn_implementation="eager")
    torch.manual_seed(0)
    return perturb_uniform_parameters(GPT2LMHeadModel(cfg)).eval()


class _Logits(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False, return_dict=False)[0]


class DecodeStep(nn.Module):
    """One token of GPT-2 given the cache of `past` earlier positions.

    Inputs: input_ids [B, 1], then past_key_i, past_value_i [B, heads, past, head_dim] per
    layer. Outputs: logits [B, 1, vocab], then present_key_i, present_value_i with
    past + 1 positions. Every cached position is valid, so no mask is needed; the new
    token sits at position `past`.
    """

    def __init__(self, lm: nn.Module, past: int):
        super().__init__()
        self.tr = lm.transformer
        self.lm_head = lm.lm_head
        self.past = past
        self.n_head = lm.config.n_head
        self.head_dim = lm.config.n_embd // lm.config.n_head

    def _heads(self, t):  # [B, 1, E] -> [B, H, 1, D]
        return t.view(t.shape[0], 1, self.n_head, self.head_dim).transpose(1, 2)

    def forward(self, input_ids, *cache):
        h = self.tr.wte(input_ids) + self.tr.wpe.weight[self.past:self.past + 1]
        presents = []
        for i, block in enumerate(self.tr.h):
            a = block.ln_1(h)
            q, k, v = block.attn.c_attn(a).split(block.attn.embed_dim, dim=2)
            k = torch.cat([cache[2 * i], self._heads(k)], dim=2)
            v = torch.cat([cache[2 * i + 1], self._heads(v)], dim=2)
            scores = self._heads(q) @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
            ctx = torch.softmax(scores, dim=-1) @ v  # [B, H, 1, D]
            ctx = ctx.transpose(1, 2).reshape(h.shape)
            h = h + block.attn.c_proj(ctx)
            h = h + block.mlp(block.ln_2(h))
            presents += [k, v]
        return (self.lm_head(self.tr.ln_f(h)), *presents)


def _size(small: bool) -> dict:
    return SMALL if small else FULL


def gpt2_prefill_recipe(small: bool, batch: int = 1) -> Recipe:
    p = _size(small)
    lm = _hf_gpt2(small)
    return Recipe(
        name="gpt2_prefill_small" if small else "gpt2_prefill",
        module=_Logits(lm),
        inputs=(TensorSpec("input_ids", (batch, p["seq"]), "int64", 0, p["vocab_size"] - 1),),
        outputs=("logits",),
        description=(f"GPT-2 prefill (causal LM over {p['seq']} tokens), {p['n_layer']} layers, "
                     f"n_embd {p['n_embd']}, {p['n_head']} heads, vocab {p['vocab_size']}; random weights"),
        exporter="dynamo", opset=18)


def gpt2_decode_recipe(small: bool, batch: int = 1) -> Recipe:
    p = _size(small)
    lm = _hf_gpt2(small)
    head_dim = p["n_embd"] // p["n_head"]
    cache_shape = (batch, p["n_head"], p["past"], head_dim)
    cache = []
    for i in range(p["n_layer"]):
        cache += [TensorSpec(f"past_key_{i}", cache_shape, "float32"),
                  TensorSpec(f"past_value_{i}", cache_shape, "float32")]
    outputs = ["logits"]
    for i in range(p["n_layer"]):
        outputs += [f"present_key_{i}", f"present_value_{i}"]
    return Recipe(
        name="gpt2_decode_small" if small else "gpt2_decode",
        module=DecodeStep(lm, p["past"]),
        inputs=(TensorSpec("input_ids", (batch, 1), "int64", 0, p["vocab_size"] - 1), *cache),
        outputs=tuple(outputs),
        description=(f"GPT-2 decode step: one new token, KV cache of {p['past']} positions as inputs "
                     f"[batch, heads, past, head_dim]; same architecture and sizes as the prefill graph"),
        exporter="dynamo", opset=18)


@torch.no_grad()
def decode_error_vs_hf(small: bool) -> float:
    """DecodeStep fed Hugging Face's own cache of `past` tokens must reproduce the logits
    Hugging Face computes for token past + 1 over the whole sequence; returns the max
    relative difference."""
    p = _size(small)
    lm = _hf_gpt2(small)
    ids = torch.randint(0, p["vocab_size"], (1, p["past"] + 1), generator=torch.Generator().manual_seed(3))
    want = lm(input_ids=ids, use_cache=False, return_dict=False)[0][:, -1:]
    cache = lm(input_ids=ids[:, :-1], use_cache=True, return_dict=True).past_key_values
    flat = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    got = DecodeStep(lm, p["past"])(ids[:, -1:], *flat)[0]
    return float((got - want).abs().max() / want.abs().max())
