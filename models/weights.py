"""Random weights that exercise every operand: default initialisations leave biases at zero
and normalisation scales at one, which exporters then drop or de-duplicate."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def perturb_uniform_parameters(module: nn.Module, seed: int = 0, scale: float = 0.05) -> nn.Module:
    """Adds small noise to every parameter whose elements are all equal (zero biases,
    unit LayerNorm/BatchNorm scales), so each one is a distinct, non-trivial tensor."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        if p.numel() > 1 and bool(torch.all(p == p.flatten()[0])):
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return module


@torch.no_grad()
def calibrate_batchnorm(module: nn.Module, example: torch.Tensor, steps: int = 2) -> nn.Module:
    """Sets BatchNorm running statistics from a few forward passes over random data, so that
    eval-mode BN keeps activations near unit scale through a deep random network."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration passes
    module.train()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        module(torch.randn(example.shape, generator=gen))
    return module.eval()
