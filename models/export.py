"""torch module -> cleaned, checked ONNX model plus its manifest entry."""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from .onnx_tools import (TensorSpec, dynamic_tensors, fold_constants, graph_specs,
                         initializer_elements, op_histogram, run_onnxruntime,
                         sample_inputs, unsupported_ops)


@dataclass(frozen=True, eq=False)
class Recipe:
    """What to export: a module in eval mode, its static inputs, and the exporter that works
    for it (dynamo for most; the legacy TorchScript exporter where dynamo fails)."""
    name: str
    module: torch.nn.Module
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    description: str
    exporter: str = "dynamo"
    opset: int = 18


@dataclass(frozen=True)
class Exported:
    model: onnx.ModelProto
    manifest: dict


def _torch_args(recipe: Recipe, seed: int) -> tuple[dict, tuple]:
    feeds = sample_inputs(recipe.inputs, seed)
    return feeds, tuple(torch.from_numpy(feeds[s.name]) for s in recipe.inputs)


def _export_raw(recipe: Recipe, args: tuple) -> onnx.ModelProto:
    names = dict(input_names=[s.name for s in recipe.inputs], output_names=list(recipe.outputs))
    if recipe.exporter == "dynamo":
        program = torch.onnx.export(recipe.module, args, dynamo=True, opset_version=recipe.opset,
                                    optimize=True, verbose=False, **names)
        return program.model_proto
    if recipe.exporter == "legacy":
        buf = io.BytesIO()
        # do_constant_folding=False keeps BatchNormalization as its own node (the legacy
        # exporter would fuse it into Conv); fold_constants does the rest of the folding.
        torch.onnx.export(recipe.module, args, buf, dynamo=False, opset_version=recipe.opset,
                          do_constant_folding=False, **names)
        return onnx.load_from_string(buf.getvalue())
    raise ValueError(f"unknown exporter {recipe.exporter!r} for {recipe.name}")


def _torch_reference(module: torch.nn.Module, args: tuple) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*args)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach().numpy() for o in out]


def _max_relative_error(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - want))) / scale


def check_model(model: onnx.ModelProto, name: str) -> None:
    """The properties every bundled model must have; raises with what is wrong."""
    onnx.checker.check_model(model, full_check=True)
    bad_ops = unsupported_ops(model)
    if bad_ops:
        raise ValueError(f"{name}: op types outside the frontend's set: {bad_ops}")
    dynamic = dynamic_tensors(model)
    if dynamic:
        raise ValueError(f"{name}: tensors without a static shape: {dynamic[:10]}")


def export(recipe: Recipe, seed: int = 0, rel_tol: float = 1e-4) -> Exported:
    """Export, fold constants, check (checker, ops, static shapes), run onnxruntime and
    compare with torch: max |ort - torch| / max |torch| must stay under rel_tol (fp32)."""
    recipe.module.eval()
    feeds, args = _torch_args(recipe, seed)
    model = fold_constants(_export_raw(recipe, args))
    model.producer_name = "powerfusion-models"
    model.doc_string = recipe.description
    check_model(model, recipe.name)

    got = run_onnxruntime(model, feeds)
    errors = {}
    for name, want in zip(recipe.outputs, _torch_reference(recipe.module, args)):
        if not np.all(np.isfinite(got[name])):
            raise ValueError(f"{recipe.name}: output {name} has non-finite values")
        errors[name] = _max_relative_error(got[name], want)
        if errors[name] > rel_tol:
            raise ValueError(f"{recipe.name}: output {name} differs from torch by {errors[name]:.2e} (relative)")

    outputs = graph_specs(model, "output")
    manifest = {
        "file": f"{recipe.name}.onnx",
        "description": recipe.description,
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "inputs": [s.to_json() for s in recipe.inputs],
        "outputs": [s.to_json() for s in outputs],
        "size_bytes": model.ByteSize(),
        "parameters": int(sum(p.numel() for p in recipe.module.parameters())),
        "initializer_elements": initializer_elements(model),
        "op_histogram": op_histogram(model),
        "max_relative_error_vs_torch": {k: float(f"{v:.3g}") for k, v in errors.items()},
    }
    return Exported(model, manifest)
