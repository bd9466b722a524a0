"""Build every model: `python3 -m models.build --out DIR [--small] [--only NAME ...]`.

Each model is exported from torch with random weights, constant-folded to static shapes,
checked (onnx.checker, op set, static shapes, onnxruntime against torch) and written as
DIR/<name>.onnx; DIR/manifest.json describes them all.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import onnx

from .onnx_tools import FRONTEND_OPS

MANIFEST = "manifest.json"


def _recipes() -> dict[str, Callable]:
    # imported here so that `models` itself never needs torch
    from .bert import bert_recipe
    from .efficientnet import efficientnet_recipe
    from .gpt2 import gpt2_decode_recipe, gpt2_prefill_recipe
    from .rednet import rednet_recipe
    from .resnet import resnet_recipe
    from .sardrn import sardrn_recipe
    from .shufflenet import shufflenet_recipe
    from .vit import vit_recipe
    return {"bert": bert_recipe, "gpt2_prefill": gpt2_prefill_recipe,
            "gpt2_decode": gpt2_decode_recipe, "vit": vit_recipe,
            "shufflenet": shufflenet_recipe, "efficientnet": efficientnet_recipe,
            "resnet": resnet_recipe, "sardrn": sardrn_recipe, "rednet": rednet_recipe}


MODEL_KEYS = ("bert", "gpt2_prefill", "gpt2_decode", "vit", "shufflenet", "efficientnet",
              "resnet", "sardrn", "rednet")


def _self_checks(small: bool, keys: list[str]) -> dict:
    """Hand-written pieces checked against their reference implementations in torch."""
    checks = {}
    if "gpt2_decode" in keys:
        from .gpt2 import decode_error_vs_hf
        checks["gpt2_decode_vs_transformers_cache"] = err = decode_error_vs_hf(small)
        if err > 1e-4:
            raise ValueError(f"GPT-2 decode step differs from transformers by {err:.2e} (relative)")
    if "rednet" in keys:
        from .rednet import windows_error_vs_unfold
        checks["involution_windows_vs_unfold"] = err = windows_error_vs_unfold()
        if err != 0.0:
            raise ValueError(f"involution windows differ from nn.functional.unfold by {err}")
    return {k: float(f"{v:.3g}") for k, v in checks.items()}


def _previous_entries(out: Path) -> dict:
    """A partial rebuild (--only) keeps the other models' manifest entries."""
    path = out / MANIFEST
    return json.loads(path.read_text())["models"] if path.exists() else {}


def build(out: Path, small: bool, keys: list[str] | None = None, log=print) -> dict:
    """Exports the selected models into `out` and writes the manifest; returns it."""
    import torch
    import transformers
    keys = list(keys or MODEL_KEYS)
    recipes = _recipes()
    out.mkdir(parents=True, exist_ok=True)
    from .export import export
    manifest = {
        "command": "python3 -m models.build" + (" --small" if small else ""),
        "versions": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
                     "onnx": onnx.__version__},
        "frontend_ops": sorted(FRONTEND_OPS),
        "self_checks": _self_checks(small, keys),
        "models": _previous_entries(out) if keys != list(MODEL_KEYS) else {},
    }
    for key in keys:
        start = time.perf_counter()
        recipe = recipes[key](small)
        exported = export(recipe)
        onnx.save(exported.model, out / exported.manifest["file"])
        manifest["models"][recipe.name] = exported.manifest
        log(f"{recipe.name}: {exported.manifest['size_bytes'] / 1e6:.2f} MB, "
            f"{exported.manifest['parameters']:,} parameters, {time.perf_counter() - start:.1f} s")
    manifest["models"] = dict(sorted(manifest["models"].items()))
    manifest["total_bytes"] = sum(m["size_bytes"] for m in manifest["models"].values())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m models.build", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--small", action="store_true", help="the small versions (committed in models/small)")
    ap.add_argument("--only", nargs="+", choices=MODEL_KEYS, help="build only these models")
    args = ap.parse_args(argv)
    manifest = build(args.out, args.small, args.only)
    print(f"{len(manifest['models'])} models, {manifest['total_bytes'] / 1e6:.2f} MB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
