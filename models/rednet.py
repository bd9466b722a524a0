"""RedNet: ResNet bottlenecks whose 3x3 convolution is replaced by involution (Li et al.,
"Involution: Inverting the Inherence of Convolution", 2021), written in plain torch.

Involution generates a K x K kernel per output pixel and per channel group with two 1x1
convolutions, then applies it to the K x K window around the pixel: multiply and sum.
The windows are taken with Pad + strided Slices + Concat (what nn.Unfold computes), so the
exported graph stays within plain ONNX ops.
"""
from __future__ import annotations

import torch
from torch import nn

from .cnn import cnn_recipe, conv_bn
from .resnet import ResNet


def windows(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, C, K*K, Ho, Wo]: the zero-padded K x K window of every output
    pixel, window positions in row-major order (the layout of nn.functional.unfold)."""
    pad = (kernel - 1) // 2
    h_out = (x.shape[2] + 2 * pad - kernel) // stride + 1
    w_out = (x.shape[3] + 2 * pad - kernel) // stride + 1
    xp = nn.functional.pad(x, (pad, pad, pad, pad))
    taps = [xp[:, :, i:i + stride * (h_out - 1) + 1:stride, j:j + stride * (w_out - 1) + 1:stride]
            for i in range(kernel) for j in range(kernel)]
    return torch.stack(taps, dim=2)


class Involution(nn.Module):
    def __init__(self, channels: int, kernel: int, stride: int, group_channels: int = 16,
                 reduction: int = 4):
        super().__init__()
        self.kernel, self.stride = kernel, stride
        self.groups = channels // group_channels
        self.pool = nn.AvgPool2d(stride, stride) if stride > 1 else nn.Identity()
        self.reduce = conv_bn(channels, channels // reduction, 1)
        self.span = nn.Conv2d(channels // reduction, kernel * kernel * self.groups, 1)

    def forward(self, x):
        weight = self.span(self.reduce(self.pool(x)))  # [B, G*K*K, Ho, Wo]
        b, _, h, w = weight.shape
        kk = self.kernel * self.kernel
        weight = weight.view(b, self.groups, 1, kk, h * w)
        patches = windows(x, self.kernel, self.stride).view(b, self.groups, -1, kk, h * w)
        return (weight * patches).sum(dim=3).view(b, -1, h, w)


def involution_bn_relu(group_channels: int):
    def make(channels: int, stride: int) -> nn.Module:
        return nn.Sequential(Involution(channels, 7, stride, group_channels),
                             nn.BatchNorm2d(channels), nn.ReLU())
    return make


def rednet_stem(stem_channels: int, group_channels: int) -> nn.Module:
    half = stem_channels // 2
    return nn.Sequential(conv_bn(3, half, 3, 2), Involution(half, 3, 1, group_channels),
                         nn.BatchNorm2d(half), nn.ReLU(), conv_bn(half, stem_channels, 3))


FULL = dict(stem=64, width=64, blocks=(3, 4, 6, 3), group_channels=16, num_classes=1000, image=224)
SMALL = dict(stem=16, width=8, blocks=(1, 1, 1, 1), group_channels=8, num_classes=10, image=64)


def rednet_recipe(small: bool, batch: int = 1):
    p = SMALL if small else FULL
    w, g = p["width"], p["group_channels"]
    model = ResNet(rednet_stem(p["stem"], g), p["stem"], w, p["blocks"], p["num_classes"],
                   spatial=involution_bn_relu(g))
    return cnn_recipe("rednet_small" if small else "rednet50", model,
                      (batch, 3, p["image"], p["image"]), "logits",
                      f"RedNet (involution bottlenecks, 7x7 involution, {g} channels per group), width "
                      f"{w}, blocks {p['blocks']}, {p['image']}x{p['image']} input, "
                      f"{p['num_classes']} classes; random weights")


@torch.no_grad()
def windows_error_vs_unfold() -> float:
    """windows() must equal nn.functional.unfold for the strides and kernels used here."""
    x = torch.randn(2, 8, 13, 11, generator=torch.Generator().manual_seed(0))
    worst = 0.0
    for k, s in ((3, 1), (7, 1), (7, 2)):
        got = windows(x, k, s).flatten(3)
        want = nn.functional.unfold(x, k, padding=(k - 1) // 2, stride=s).view_as(got)
        worst = max(worst, float((got - want).abs().max()))
    return worst
