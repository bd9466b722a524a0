"""Shared pieces of the convolutional builders: conv + BN (+ activation) and the recipe."""
from __future__ import annotations

import torch
from torch import nn

from .export import Recipe
from .onnx_tools import TensorSpec
from .weights import calibrate_batchnorm, perturb_uniform_parameters


def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, dilation: int = 1,
            act: type[nn.Module] | None = nn.ReLU) -> nn.Sequential:
    """k x k convolution without bias ('same' padding for odd k), BatchNorm, optional activation."""
    layers = [nn.Conv2d(cin, cout, k, stride, dilation * (k - 1) // 2, dilation, groups, bias=False),
              nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


def cnn_recipe(name: str, module: nn.Module, input_shape: tuple[int, ...], output: str,
               description: str) -> Recipe:
    """Random weights (distinct BN scales and shifts), BN statistics calibrated on random
    data so activations stay bounded. Exported with the TorchScript exporter at opset 17,
    which keeps BatchNormalization nodes and global pooling as GlobalAveragePool, as
    classic CNN files have them (the dynamo exporter folds BN into Conv)."""
    torch.manual_seed(0)
    perturb_uniform_parameters(module)
    calibrate_batchnorm(module, torch.zeros((2,) + tuple(input_shape[1:])))
    return Recipe(name=name, module=module,
                  inputs=(TensorSpec("input", tuple(input_shape), "float32"),),
                  outputs=(output,), description=description, exporter="legacy", opset=17)
