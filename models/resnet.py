"""ResNet-50 (v1.5: stride on the 3x3 convolution), written in plain torch."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .cnn import cnn_recipe, conv_bn

# (channels, stride) -> module producing the bottleneck's spatial mixing (3x3 conv in ResNet)
SpatialFactory = Callable[[int, int], nn.Module]


def conv3x3_bn_relu(channels: int, stride: int) -> nn.Module:
    return conv_bn(channels, channels, 3, stride)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, spatial: SpatialFactory):
        super().__init__()
        cout = planes * self.expansion
        self.body = nn.Sequential(conv_bn(cin, planes, 1), spatial(planes, stride),
                                  conv_bn(planes, cout, 1, act=None))
        self.shortcut = (conv_bn(cin, cout, 1, stride, act=None)
                         if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, four bottleneck stages of widths w, 2w, 4w, 8w, global pooling, classifier."""

    def __init__(self, stem: nn.Module, stem_channels: int, width: int, blocks: tuple[int, ...],
                 num_classes: int, spatial: SpatialFactory = conv3x3_bn_relu):
        super().__init__()
        layers, cin = [], stem_channels
        for i, n in enumerate(blocks):
            planes = width * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, planes, 2 if (j == 0 and i > 0) else 1, spatial))
                cin = planes * Bottleneck.expansion
        self.stem = stem
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.stages(self.pool(self.stem(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


FULL = dict(width=64, blocks=(3, 4, 6, 3), num_classes=1000, image=224)
SMALL = dict(width=8, blocks=(1, 1, 1, 1), num_classes=10, image=64)


def resnet_recipe(small: bool, batch: int = 1):
    p = SMALL if small else FULL
    w = p["width"]
    model = ResNet(conv_bn(3, w, 7, 2), w, w, p["blocks"], p["num_classes"])
    name = "resnet_small" if small else "resnet50"
    return cnn_recipe(name, model, (batch, 3, p["image"], p["image"]), "logits",
                      f"ResNet-50 architecture (v1.5 bottlenecks), width {w}, blocks {p['blocks']}, "
                      f"{p['image']}x{p['image']} input, {p['num_classes']} classes; random weights")
