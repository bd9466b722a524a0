"""SAR-DRN: a despeckling CNN of seven dilated convolutions (dilations 1,2,3,4,3,2,1) with BN +
ReLU in the middle layers, two skip connections, and residual learning (output = input - noise)."""
from __future__ import annotations

from torch import nn

from .cnn import cnn_recipe, conv_bn

FULL = dict(channels=64, image=256)
SMALL = dict(channels=16, image=64)


class SARDRN(nn.Module):
    def __init__(self, channels: int, image_channels: int = 1):
        super().__init__()
        c = channels
        self.l1 = nn.Sequential(nn.Conv2d(image_channels, c, 3, padding=1), nn.ReLU())
        self.l2 = conv_bn(c, c, 3, dilation=2)
        self.l3 = conv_bn(c, c, 3, dilation=3)
        self.l4 = conv_bn(c, c, 3, dilation=4)
        self.l5 = conv_bn(c, c, 3, dilation=3)
        self.l6 = conv_bn(c, c, 3, dilation=2)
        self.l7 = nn.Conv2d(c, image_channels, 3, padding=1)

    def forward(self, x):
        y1 = self.l1(x)
        y3 = self.l3(self.l2(y1)) + y1  # skip connection 1 -> 3
        y4 = self.l4(y3)
        y6 = self.l6(self.l5(y4)) + y4  # skip connection 4 -> 6
        return x - self.l7(y6)  # the network predicts the speckle; subtract it


def sardrn_recipe(small: bool, batch: int = 1):
    p = SMALL if small else FULL
    return cnn_recipe("sardrn_small" if small else "sardrn", SARDRN(p["channels"]),
                      (batch, 1, p["image"], p["image"]), "despeckled",
                      f"SAR-DRN despeckling CNN, {p['channels']} channels, one-channel "
                      f"{p['image']}x{p['image']} image in and out; random weights")
