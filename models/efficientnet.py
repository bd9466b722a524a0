"""EfficientNet-B0 (MBConv blocks with squeeze-and-excitation and SiLU), in plain torch."""
from __future__ import annotations

import math

from torch import nn

from .cnn import cnn_recipe, conv_bn

# expand ratio, kernel, stride, output channels, repeats (B0)
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
FULL = dict(width=1.0, depth=1.0, num_classes=1000, image=224)
SMALL = dict(width=0.25, depth=0.25, num_classes=10, image=64)


def make_divisible(v: float, divisor: int = 8) -> int:
    """Channel rounding of the reference implementation: nearest multiple, never 10% below."""
    out = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * v else out


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(channels, squeeze, 1), nn.SiLU(),
                                  nn.Conv2d(squeeze, channels, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.gate(x)


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, k: int, stride: int):
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn(cin, hidden, 1, act=nn.SiLU)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, k, stride, groups=hidden, act=nn.SiLU),
                   SqueezeExcite(hidden, max(1, cin // 4)),
                   conv_bn(hidden, cout, 1, act=None)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class EfficientNet(nn.Module):
    def __init__(self, width: float, depth: float, num_classes: int):
        super().__init__()
        stem = make_divisible(32 * width)
        blocks, cin = [], stem
        for expand, k, stride, c, n in STAGES:
            cout = make_divisible(c * width)
            for i in range(math.ceil(n * depth)):
                blocks.append(MBConv(cin, cout, expand, k, stride if i == 0 else 1))
                cin = cout
        head = make_divisible(1280 * width)
        self.features = nn.Sequential(conv_bn(3, stem, 3, 2, act=nn.SiLU), *blocks,
                                      conv_bn(cin, head, 1, act=nn.SiLU), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten(), nn.Dropout(0.2))
        self.classifier = nn.Linear(head, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def efficientnet_recipe(small: bool, batch: int = 1):
    p = SMALL if small else FULL
    model = EfficientNet(p["width"], p["depth"], p["num_classes"])
    return cnn_recipe("efficientnet_small" if small else "efficientnet_b0", model,
                      (batch, 3, p["image"], p["image"]), "logits",
                      f"EfficientNet-B0 layout, width x{p['width']}, depth x{p['depth']}, "
                      f"{p['image']}x{p['image']} input, {p['num_classes']} classes; random weights")
