"""Model builders (random weights, no downloads) and the small bundled models.

`python3 -m models.build --out DIR [--small]` exports every model; `models/small/` holds the
committed small versions and their manifest. Importing this package does not import torch.
"""
from __future__ import annotations

import json
from pathlib import Path

SMALL_DIR = Path(__file__).resolve().parent / "small"


def small_manifest() -> dict:
    """models/small/manifest.json: per model its inputs (with integer ranges), outputs,
    opset, size, parameter count and op histogram."""
    return json.loads((SMALL_DIR / "manifest.json").read_text())


def small_model_path(name: str) -> Path:
    """Path of a committed small model, e.g. small_model_path("gpt2_decode_small")."""
    models = small_manifest()["models"]
    if name not in models:
        raise KeyError(f"no bundled model {name!r}; available: {', '.join(sorted(models))}")
    return SMALL_DIR / models[name]["file"]
