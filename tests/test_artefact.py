"""Compiled folders: `compile -o DIR` writes artefact.json; loading checks toolchain, model and
files, and refuses stale or tampered folders with a message that says so. Running one needs a GPU."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import powerfusion
from powerfusion.artefact import ArtefactError, load_artefact
from powerfusion.cli import main
from tests.session_cases import SMALL


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("artefact")
    model = root / "sardrn_small.onnx"
    shutil.copy(SMALL / "sardrn_small.onnx", model)
    out = root / "out"
    assert main(["-q", "compile", str(model), "-o", str(out), "--target", "cuda"]) == 0
    return model, out


def _copy(compiled, tmp_path):
    model, out = compiled
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    return model, folder


def test_fresh_folder_loads_with_the_models_interface(compiled):
    model, out = compiled
    art = load_artefact(out)
    sess_cpu = powerfusion.InferenceSession(str(model))
    assert [t.name for t in art.graph.inputs] == [i.name for i in sess_cpu.get_inputs()]
    assert [(t.name, t.shape) for t in art.graph.outputs] == [(o.name, tuple(o.shape)) for o in sess_cpu.get_outputs()]
    assert set(art.manifest["files"]) >= {"plan.json"} and len(art.manifest["files"]) > 7


def test_tampered_kernel_source_is_refused(compiled, tmp_path):
    _, folder = _copy(compiled, tmp_path)
    source = next(folder.glob("*.cu"))
    source.write_text(source.read_text() + "\n// edited\n")
    with pytest.raises(ArtefactError, match=f"tampered.*{source.name}"):
        load_artefact(folder)


def test_missing_file_and_missing_manifest_are_refused(compiled, tmp_path):
    _, folder = _copy(compiled, tmp_path)
    next(folder.glob("*.cu")).unlink()
    with pytest.raises(ArtefactError, match="missing"):
        load_artefact(folder)
    (folder / "artefact.json").unlink()
    with pytest.raises(ArtefactError, match="not a folder written by `powerfusion compile"):
        load_artefact(folder)


def test_changed_model_makes_the_folder_stale(compiled, tmp_path):
    model, out = compiled
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    changed = tmp_path / "model.onnx"
    shutil.copy(model, changed)
    manifest = json.loads((folder / "artefact.json").read_text())
    manifest["model"]["path"] = str(changed)
    (folder / "artefact.json").write_text(json.dumps(manifest))
    load_artefact(folder)                                   # same bytes: fine
    changed.write_bytes(changed.read_bytes() + b"\0")
    with pytest.raises(ArtefactError, match="stale.*has changed"):
        load_artefact(folder)


def test_other_toolchain_makes_the_folder_stale(compiled, monkeypatch):
    import powerfusion.compile_cache as cc
    monkeypatch.setattr(cc, "code_version", lambda: "0" * 64)
    with pytest.raises(ArtefactError, match="stale.*compile the model again with this version"):
        load_artefact(compiled[1])


def test_cpu_session_on_a_compiled_folder_says_it_needs_cuda(compiled):
    with pytest.raises(powerfusion.PowerFusionError, match="runs on target 'cuda'"):
        powerfusion.InferenceSession(str(compiled[1]))


@pytest.mark.gpu
def test_compiled_folder_runs_in_a_fresh_process_without_search(compiled, tmp_path):
    """A subprocess loads the folder with the compiler's search made to fail, and its outputs
    match the CPU session's (float32: rtol 1e-4, atol 1e-5)."""
    import subprocess
    import sys
    model, out = compiled
    x = np.random.default_rng(0).standard_normal((1, 1, 64, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = (
        "import sys, numpy as np, powerfusion, powerfusion.compiler as c, powerfusion.pipeline.search as s\n"
        "import powerfusion.pipeline.driver as d, powerfusion.session as ps\n"
        "def no(*a, **k): raise SystemExit('search ran')\n"
        "d.compile = ps.compile = c.compile_model = s.choose_plan = no\n"
        f"sess = powerfusion.InferenceSession({str(out)!r}, providers=['CUDAExecutionProvider'])\n"
        f"y = sess.run(None, {{sess.get_inputs()[0].name: np.load({str(tmp_path / 'x.npy')!r})}})[0]\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, y)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    want = powerfusion.InferenceSession(str(model)).run(None, {"input": x})[0]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-4, atol=1e-5)
    assert main(["-q", "run", str(out)]) == 0
