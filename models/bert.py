"""BERT encoder (Hugging Face architecture, built from a config with random weights)."""
from __future__ import annotations

import torch

from .export import Recipe
from .onnx_tools import TensorSpec
from .weights import perturb_uniform_parameters

FULL = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072, max_position_embeddings=512, seq=128)
SMALL = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=512, max_position_embeddings=64, seq=32)


class _LastHiddenState(torch.nn.Module):
    """Returns a plain tensor so the exporter sees no ModelOutput objects."""

    def __init__(self, bert: torch.nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                         use_cache=False, return_dict=False)[0]


def bert_recipe(small: bool, batch: int = 1) -> Recipe:
    from transformers import BertConfig, BertModel
    p = dict(SMALL if small else FULL)
    seq = p.pop("seq")
    cfg = BertConfig(**p, attn_implementation="eager")
    torch.manual_seed(0)
    model = _LastHiddenState(perturb_uniform_parameters(BertModel(cfg, add_pooling_layer=False)))
    name = "bert_small" if small else "bert_base"
    return Recipe(
        name=name, module=model,
        inputs=(TensorSpec("input_ids", (batch, seq), "int64", 0, cfg.vocab_size - 1),
                TensorSpec("attention_mask", (batch, seq), "int64", 0, 1)),
        outputs=("last_hidden_state",),
        description=(f"BERT encoder, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                     f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}, seq {seq}; random weights"),
        # The dynamo exporter trips over transformers' mask construction; TorchScript works.
        exporter="legacy", opset=17)
