"""ShuffleNetV2 (x1.0 layout), written in plain torch; its channel split / concat / shuffle is
the docs/design.md running example for move merging."""
from __future__ import annotations

import torch
from torch import nn

from .cnn import cnn_recipe, conv_bn

FULL = dict(channels=(24, 116, 232, 464, 1024), repeats=(4, 8, 4), num_classes=1000, image=224)
SMALL = dict(channels=(16, 32, 64, 128, 256), repeats=(2, 2, 2), num_classes=10, image=64)


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        half = cout // 2
        self.stride = stride
        if stride > 1:  # both halves see the whole input and downsample
            self.branch1 = nn.Sequential(conv_bn(cin, cin, 3, stride, groups=cin, act=None),
                                         conv_bn(cin, half, 1))
        self.branch2 = nn.Sequential(conv_bn(cin if stride > 1 else half, half, 1),
                                     conv_bn(half, half, 3, stride, groups=half, act=None),
                                     conv_bn(half, half, 1))

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self, channels: tuple[int, ...], repeats: tuple[int, ...], num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, channels[0], 3, 2), nn.MaxPool2d(3, 2, 1))
        units, cin = [], channels[0]
        for cout, n in zip(channels[1:-1], repeats):
            units += [ShuffleUnit(cin if i == 0 else cout, cout, 2 if i == 0 else 1) for i in range(n)]
            cin = cout
        self.stages = nn.Sequential(*units)
        self.conv5 = conv_bn(cin, channels[-1], 1)
        self.fc = nn.Linear(channels[-1], num_classes)

    def forward(self, x):
        x = self.conv5(self.stages(self.stem(x)))
        return self.fc(x.mean((2, 3)))


def shufflenet_recipe(small: bool, batch: int = 1):
    p = SMALL if small else FULL
    model = ShuffleNetV2(p["channels"], p["repeats"], p["num_classes"])
    return cnn_recipe("shufflenet_small" if small else "shufflenet_v2", model,
                      (batch, 3, p["image"], p["image"]), "logits",
                      f"ShuffleNetV2, stage channels {p['channels']}, repeats {p['repeats']}, "
                      f"{p['image']}x{p['image']} input, {p['num_classes']} classes; random weights")
