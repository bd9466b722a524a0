"""Compiled folders: what `powerfusion compile MODEL -o DIR` wrote, loaded back without search.

`compile` writes `artefact.json` beside plan.json, the kernel sources and the constants:

    {"format": 1, "powerfusion": "0.1.0", "toolchain": <sha256 of the installed package>,
     "target": "cuda", "model": {"path", "sha256"}, "inputs": [...], "outputs": [...],
     "files": {file name: sha256}}

`load_artefact(DIR)` refuses, with a message that says what to do:
- a folder without artefact.json (not written by `compile`, or by an older version);
- a stale one: compiled by another PowerFusion (toolchain hash), or from a model file that
  has changed since (when that file is still where it was);
- a tampered one: a file missing, added to the plan or changed since it was written.
The hashes detect accidental change and staleness; they are not a signature (whoever can
rewrite the folder can rewrite artefact.json too), so load folders you trust, as you would
a shared library. plan.json is read as JSON only, .npy constants with allow_pickle=False,
and kernel names must be C identifiers before NVRTC sees anything.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerfusion.errors import PowerFusionError

MANIFEST = "artefact.json"
FORMAT = 1
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class ArtefactError(PowerFusionError):
    """A compiled folder that cannot be loaded: missing, stale or tampered."""


@dataclass(frozen=True)
class Artefact:
    folder: Path
    manifest: dict
    plan: dict          # plan.json
    graph: object       # BasicGraph with the model's inputs, outputs and planned tensors

    @property
    def model_path(self) -> str | None:
        path = self.manifest["model"]["path"]
        return path if os.path.isfile(path) else None

    def make_executor(self, options):
        from powerfusion.backends.cuda.artefact_runner import make_artefact_executor
        from powerfusion.targets.specs import get_target
        backend = get_target(self.manifest["target"]).backend
        if backend != "cuda":
            raise ArtefactError(f"'{self.folder}' holds {backend} kernels; only CUDA folders run from Python here")
        return make_artefact_executor(self, options)


def write_manifest(folder: str | os.PathLike, model_path: str, target: str, known: dict | None = None) -> Path:
    """artefact.json for a folder `compile` has just written (after plan.json and sources).
    `known`: digests of output files the compile cache has just verified (a restored or up-to-date
    folder), so a warm compile does not read the model's constants again."""
    from powerfusion.compile_cache import code_version, file_digest
    folder = Path(folder)
    path = folder / MANIFEST
    digest = file_digest(model_path)
    inputs, outputs = _model_io(model_path, digest, path)
    doc = {"format": FORMAT, "powerfusion": _version(), "toolchain": code_version(), "target": target,
           "model": {"path": os.path.abspath(model_path), "sha256": digest},
           "inputs": inputs, "outputs": outputs,
           "files": {name: (known or {}).get(name) or file_digest(folder / name) for name in _plan_files(folder)}}
    text = json.dumps(doc, indent=1)
    if not path.is_file() or path.read_text() != text:   # an up-to-date folder is left alone
        path.write_text(text)
    return path


def _model_io(model_path: str, digest: str, manifest: Path) -> tuple[list[str], list[str]]:
    """The model's input names (less initializers) and output names: from the folder's manifest
    where it was written for a model with these bytes (a warm compile: parsing a 500 MB model
    again for two lists of names cost a second), else from the model."""
    try:
        old = json.loads(manifest.read_text())
        names = old["inputs"], old["outputs"]
        if old["model"]["sha256"] == digest and all(isinstance(x, list) and all(isinstance(n, str) for n in x)
                                                    for x in names):
            return list(old["inputs"]), list(old["outputs"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass   # no usable manifest: read the model
    import onnx
    header = onnx.load(model_path, load_external_data=False)
    initializers = {t.name for t in header.graph.initializer}
    return ([i.name for i in header.graph.input if i.name not in initializers],
            [o.name for o in header.graph.output])


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("powerfusion")
    except metadata.PackageNotFoundError:   # a checkout on PYTHONPATH: the toolchain hash still decides
        return "unknown"


def load_artefact(folder: str | os.PathLike) -> Artefact:
    from powerfusion.compile_cache import code_version, file_digest
    folder = Path(folder)
    manifest = _read_json(folder / MANIFEST, folder, "its manifest")
    _check_keys(manifest, ("format", "toolchain", "target", "model", "inputs", "outputs", "files"), folder)
    if manifest["format"] != FORMAT:
        raise ArtefactError(f"'{folder}' was written in artefact format {manifest['format']}, this "
                            f"PowerFusion reads {FORMAT}: compile the model again")
    if manifest["toolchain"] != code_version():
        raise ArtefactError(f"'{folder}' is stale: it was compiled by PowerFusion {manifest.get('powerfusion')} "
                            f"(toolchain {manifest['toolchain'][:12]}), this installation is "
                            f"{code_version()[:12]}; compile the model again with this version")
    model = manifest["model"]
    if os.path.isfile(model["path"]) and file_digest(model["path"]) != model["sha256"]:
        raise ArtefactError(f"'{folder}' is stale: the model '{model['path']}' has changed since it was "
                            "compiled; compile it again")
    plan = _read_json(folder / "plan.json", folder, "plan.json")
    expected = set(_plan_files(folder))
    if set(manifest["files"]) != expected:
        raise ArtefactError(f"'{folder}' was tampered with: plan.json names files "
                            f"{sorted(expected ^ set(manifest['files']))[:5]} that the manifest does not (or "
                            "the other way round); compile the model again")
    for name, digest in manifest["files"].items():
        path = folder / name
        if Path(name).name != name or not path.is_file():
            raise ArtefactError(f"'{folder}': file '{name}' is missing; compile the model again")
        if file_digest(path) != digest:
            raise ArtefactError(f"'{folder}' was tampered with: '{name}' changed after it was compiled; "
                                "compile the model again")
    _check_plan(plan, folder)
    return Artefact(folder, manifest, plan, _graph(plan, manifest, folder))


def _plan_files(folder: Path) -> list[str]:
    """plan.json and every file it names (the compile cache's list of a compiled folder)."""
    from powerfusion.compile_cache import output_files
    try:
        return list(dict.fromkeys(output_files(folder / "plan.json")))
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtefactError(f"'{folder}': plan.json is not a plan this version wrote ({e!r}); "
                            "compile the model again") from None


def _read_json(path: Path, folder: Path, what: str) -> dict:
    if not folder.is_dir():
        raise ArtefactError(f"'{folder}' is not a folder")
    if not path.is_file():
        raise ArtefactError(f"'{folder}' has no {path.name}: it is not a folder written by "
                            "`powerfusion compile MODEL -o DIR` (or was written by an older version)")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtefactError(f"'{folder}': {what} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ArtefactError(f"'{folder}': {what} is not a JSON object")
    return doc


def _check_keys(doc: dict, keys, folder) -> None:
    missing = [k for k in keys if k not in doc]
    if missing:
        raise ArtefactError(f"'{folder}': artefact.json lacks {missing}; compile the model again")


def _check_plan(plan: dict, folder: Path) -> None:
    """Kernel names go to NVRTC's symbol lookup: C identifiers only."""
    for step in plan.get("steps", []):
        if step.get("kind") == "library" and step.get("op") not in ("matmul", "conv", "attention"):
            raise ArtefactError(f"'{folder}': library step '{step.get('node')}' ({step.get('op')}) cannot be run "
                                "from a compiled folder yet; run the .onnx model instead")
        for k in step.get("kernels", []):
            if not _IDENTIFIER.match(str(k.get("name", ""))):
                raise ArtefactError(f"'{folder}': kernel name {k.get('name')!r} is not a C identifier")


def _graph(plan: dict, manifest: dict, folder: Path):
    from powerfusion.basic import BasicGraph, TensorInfo
    from powerfusion.gir.interpreter import np_dtype
    tensors = {}
    for name, t in plan["tensors"].items():
        tensors[name] = TensorInfo(name, tuple(int(d) for d in t["shape"]), np.dtype(np_dtype(t["dtype"])))
    unknown = [n for n in manifest["inputs"] + manifest["outputs"] if n not in tensors]
    if unknown:
        raise ArtefactError(f"'{folder}': plan.json does not describe tensors {unknown}; compile the model again")
    return BasicGraph(name=plan.get("model", "model"), inputs=[tensors[n] for n in manifest["inputs"]],
                      outputs=[tensors[n] for n in manifest["outputs"]], tensors=tensors, constants={}, nodes=[])
