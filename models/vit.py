"""Vision Transformer (Hugging Face ViTForImageClassification, built from a config)."""
from __future__ import annotations

import torch

from .export import Recipe
from .onnx_tools import TensorSpec
from .weights import perturb_uniform_parameters

FULL = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
            num_attention_heads=12, intermediate_size=3072, num_labels=1000)
SMALL = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=2, intermediate_size=256, num_labels=10)


class _Logits(torch.nn.Module):
    def __init__(self, vit: torch.nn.Module):
        super().__init__()
        self.vit = vit

    def forward(self, pixel_values):
        return self.vit(pixel_values=pixel_values, return_dict=False)[0]


def vit_recipe(small: bool, batch: int = 1) -> Recipe:
    from transformers import ViTConfig, ViTForImageClassification
    p = SMALL if small else FULL
    cfg = ViTConfig(**p, attn_implementation="eager")
    torch.manual_seed(0)
    model = _Logits(perturb_uniform_parameters(ViTForImageClassification(cfg)))
    size = p["image_size"]
    return Recipe(
        name="vit_small" if small else "vit_b16",
        module=model,
        inputs=(TensorSpec("pixel_values", (batch, 3, size, size), "float32"),),
        outputs=("logits",),
        description=(f"ViT image classifier, {size}x{size} input, patch {p['patch_size']}, "
                     f"{p['num_hidden_layers']} layers, hidden {p['hidden_size']}, "
                     f"{p['num_attention_heads']} heads, {p['num_labels']} classes; random weights"),
        exporter="dynamo", opset=18)
