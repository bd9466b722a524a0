"""The bundled small models (models/small in a checkout, powerfusion/demo_models when installed
from a wheel), by name: `powerfusion run sardrn_small`, `pf.demo_model("resnet_small")`."""
from __future__ import annotations

import os
from pathlib import Path

from powerfusion.errors import PowerFusionError


def models_dir() -> Path | None:
    package = Path(__file__).resolve().parent
    for folder in (package / "demo_models", package.parent / "models" / "small"):
        if (folder / "manifest.json").is_file():
            return folder
    return None


def names() -> list[str]:
    folder = models_dir()
    return sorted(p.stem for p in folder.glob("*.onnx")) if folder else []


def demo_model(name: str) -> str:
    """The path of bundled model `name` ("resnet_small" or "resnet_small.onnx")."""
    folder = models_dir()
    stem = Path(name).name.removesuffix(".onnx")
    if folder is None or not (folder / f"{stem}.onnx").is_file():
        raise PowerFusionError(f"no bundled model {name!r}; bundled: {', '.join(names()) or 'none installed'}")
    return str(folder / f"{stem}.onnx")


def resolve(path: str) -> str:
    """`path` if it exists, else the bundled model of that name (models/small/x.onnx from a
    checkout's README also resolves when installed from a wheel)."""
    if os.path.exists(path):
        return path
    stem = Path(path).name.removesuffix(".onnx")
    return demo_model(stem) if stem in names() else path
