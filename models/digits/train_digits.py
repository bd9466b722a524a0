"""Train two small classifiers on scikit-learn's bundled 8x8 digits and export them to ONNX.

    python3 -m models.digits.train_digits --out models/digits

Nothing is downloaded: `sklearn.datasets.load_digits` ships inside scikit-learn (1797 images).
The split is fixed (seed 0, 20 % held out, stratified). Writes

- digits_cnn.onnx: Conv(1->16, 3x3) ReLU Conv(16->32, 3x3) ReLU MaxPool Gemm ReLU Gemm;
- digits_transformer.onnx: the 8 image rows as tokens, one pre-norm encoder block
  (4-head self-attention, MLP), mean over tokens, a linear head;
- digits_cnn_imbalanced.onnx: digits_cnn with its first conv's output channels scaled by
  factors 2**-6 .. 2**6 and the second conv's input channels by the inverses. ReLU commutes
  with positive scales, so the function is the same (up to float rounding), but per-tensor
  INT8 ranges now fit the largest channel and crush the smallest -- the situation
  (MobileNet-like channel ranges) where weight equalisation is needed;
- digits_data.npz: x_calib (200 training images), x_test, y_test (held out), x_train, y_train.

Batch dimension: fixed at export (`--batch`, default 1) is avoided; both models take
[N, 1, 8, 8] float32 with a symbolic N (sessions fix it with `shapes`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def load_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]          # [N, 1, 8, 8] in [0, 1]
    return train_test_split(x, d.target.astype(np.int64), test_size=0.2, random_state=seed, stratify=d.target)


def cnn():
    import torch.nn as nn
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def transformer(d: int = 32, heads: int = 4):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, d)
            self.pos = nn.Parameter(torch.randn(1, 8, d) * 0.1)
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            self.head = nn.Linear(d, 10)

        def forward(self, x):                                    # x [N, 1, 8, 8]
            n = x.shape[0]
            h = self.embed(x.reshape(n, 8, 8)) + self.pos
            q, k, v = self.qkv(self.norm1(h)).reshape(n, 8, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, dim=-1)
            h = h + self.proj((att @ v).transpose(1, 2).reshape(n, 8, d))
            h = h + self.mlp(self.norm2(h))
            return self.head(h.mean(dim=1))

    return Block()


def train(model, x, y, epochs: int, seed: int):
    import torch
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(epochs):
        perm = torch.randperm(len(xt))
        for i in range(0, len(xt), 64):
            idx = perm[i:i + 64]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
    return model.eval()


def imbalance(model, low: float = -6.0, high: float = 6.0):
    """Scale conv1's output channel c by s_c and conv2's input channel c by 1 / s_c."""
    import torch
    conv1, conv2 = model[0], model[2]
    s = torch.pow(2.0, torch.linspace(low, high, conv1.out_channels))
    with torch.no_grad():
        conv1.weight.mul_(s[:, None, None, None])
        conv1.bias.mul_(s)
        conv2.weight.div_(s[None, :, None, None])
    return model


def export(model, path: Path, opset: int = 17) -> None:
    import torch
    x = torch.zeros(1, 1, 8, 8)
    torch.onnx.export(model, (x,), str(path), input_names=["image"], output_names=["logits"], opset_version=opset,
                      dynamo=False, dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}})


def accuracy(model, x, y) -> float:
    import torch
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def main(argv=None) -> None:
    import copy

    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models/digits")
    p.add_argument("--epochs", type=int, default=30)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    x_tr, x_te, y_tr, y_te = load_split()
    np.savez_compressed(out / "digits_data.npz", x_calib=x_tr[:200], x_test=x_te, y_test=y_te,
                        x_train=x_tr, y_train=y_tr)
    models = {"digits_cnn": train(cnn(), x_tr, y_tr, args.epochs, 1),
              "digits_transformer": train(transformer(), x_tr, y_tr, args.epochs * 2, 2)}
    models["digits_cnn_imbalanced"] = imbalance(copy.deepcopy(models["digits_cnn"]))
    for name, model in models.items():
        export(model, out / f"{name}.onnx")
        print(f"{name}: held-out accuracy {accuracy(model, x_te, y_te):.4f} (torch fp32)")


if __name__ == "__main__":
    main()
