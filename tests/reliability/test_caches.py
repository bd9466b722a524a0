"""Caches that cannot be trusted or used: foreign entries, shared files, a cache folder that is
a file, read-only or on a full disk, and `cache clear` that must say what it did."""
from __future__ import annotations

import errno
import os
import shutil
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h

import powerfusion
import powerfusion.cli as cli
from powerfusion import compile_cache
from powerfusion.pipeline import plancache
from powerfusion import errors as cache_warning
from powerfusion.runtime.cache import KernelCache
from powerfusion.errors import CacheWarning


def _unary_model(op: str) -> onnx.ModelProto:
    g = h.make_graph([h.make_node(op, ["x"], ["y"])], op.lower(), [h.make_tensor_value_info("x", T.FLOAT, [8, 64])],
                     [h.make_tensor_value_info("y", T.FLOAT, [8, 64])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def models(tmp_path):
    paths = {}
    for op in ("Relu", "Sigmoid"):
        paths[op] = tmp_path / f"{op}.onnx"
        onnx.save(_unary_model(op), paths[op])
    return paths


@pytest.fixture(autouse=True)
def fresh():
    plancache.clear_memo()
    cache_warning.reset_cache_warnings()
    yield
    plancache.clear_memo()
    cache_warning.reset_cache_warnings()


def _compile(capsys, cache, model, out, *extra):
    code = cli.main(["--cache-dir", str(cache), "compile", str(model), "-o", str(out), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.err


def _kernel_text(out) -> str:
    return "".join(p.read_text() for p in sorted(out.glob("*.cu")))


def test_a_compile_entry_of_another_model_is_not_restored(capsys, tmp_path, models):
    cache = tmp_path / "cache"
    _compile(capsys, cache, models["Relu"], tmp_path / "relu")
    [relu_entry] = compile_cache.entries(cache)
    sig_key, _ = compile_cache.compile_key(str(models["Sigmoid"]), "cuda", None, ".cu")
    shutil.copytree(relu_entry, relu_entry.parent / sig_key)       # the Relu entry under the Sigmoid key
    err = _compile(capsys, cache, models["Sigmoid"], tmp_path / "sig")
    assert "cached compile" not in err
    assert "expf" in _kernel_text(tmp_path / "sig") and "expf" not in _kernel_text(tmp_path / "relu")


def test_an_edited_compile_entry_is_not_restored(capsys, tmp_path, models):
    cache = tmp_path / "cache"
    _compile(capsys, cache, models["Relu"], tmp_path / "a")
    [entry] = compile_cache.entries(cache)
    text = (entry / compile_cache.ENTRY).read_text()
    (entry / compile_cache.ENTRY).write_text(text.replace('"kernels": 1', '"kernels": 7'))
    assert "cached compile" not in _compile(capsys, cache, models["Relu"], tmp_path / "b")


def test_output_folders_share_no_files(capsys, tmp_path, models):
    cache = tmp_path / "cache"
    _compile(capsys, cache, models["Relu"], tmp_path / "a")
    assert "restored" in _compile(capsys, cache, models["Relu"], tmp_path / "b")
    for f in (tmp_path / "b").iterdir():
        assert f.stat().st_nlink == 1, f
    kernel = next((tmp_path / "b").glob("*.cu"))
    before = (tmp_path / "a" / kernel.name).read_text()
    with open(kernel, "a") as f:                                  # edited in place
        f.write("// edited\n")
    assert (tmp_path / "a" / kernel.name).read_text() == before
    assert "restored" in _compile(capsys, cache, models["Relu"], tmp_path / "c")
    assert (tmp_path / "c" / kernel.name).read_text() == before


def test_cache_clear_covers_every_cache(capsys, tmp_path, models):
    cache = tmp_path / "cache"
    _compile(capsys, cache, models["Relu"], tmp_path / "a")
    assert plancache.status(cache)["entries"] >= 1
    assert cli.main(["--cache-dir", str(cache), "cache", "status"]) == 0
    assert "plan decisions: " in capsys.readouterr().out
    assert cli.main(["--cache-dir", str(cache), "cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "cached plan decision(s)" in out and "removed 0 cached plan" not in out
    assert plancache.status(cache)["entries"] == 0 and compile_cache.entries(cache) == []


def test_cache_clear_reports_what_it_could_not_remove(capsys, tmp_path, models, monkeypatch):
    cache = tmp_path / "cache"
    _compile(capsys, cache, models["Relu"], tmp_path / "a")
    KernelCache(cache / "kernels").get_or_build({"k": 1}, lambda: b"binary")
    n_plans = plancache.status(cache)["entries"]

    def refuse(self, *a, **k):   # a read-only cache (the tests may run as root, where chmod does not bind)
        raise PermissionError(errno.EROFS, "Read-only file system")

    def refuse_tree(path, *a, **k):
        raise PermissionError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("pathlib.Path.unlink", refuse)
    monkeypatch.setattr(compile_cache, "_rmtree", lambda p: ["%s: Read-only file system" % p])
    assert cli.main(["--cache-dir", str(cache), "cache", "clear"]) == 1
    captured = capsys.readouterr()
    assert "removed 0 cached kernel" in captured.out and "removed 0 cached plan" in captured.out
    assert "removed 0 cached compile" in captured.out
    assert "could not remove" in captured.err and "Read-only" in captured.err
    monkeypatch.undo()
    assert plancache.status(cache)["entries"] == n_plans and len(compile_cache.entries(cache)) == 1


def _relu_session_and_compile(capsys, cache, model, out):
    x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(8, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with powerfusion.options.context(cache_dir=cache):
            [y] = powerfusion.InferenceSession(str(model)).run(None, {"x": x})
        _compile(capsys, cache, model, out)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    return [w for w in caught if issubclass(w.category, CacheWarning)]


def test_a_cache_folder_that_is_a_file_costs_one_warning(capsys, tmp_path, models):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    caught = _relu_session_and_compile(capsys, cache, models["Relu"], tmp_path / "out")
    assert len(caught) == 1 and "cannot be used" in str(caught[0].message)
    assert (tmp_path / "out" / "plan.json").is_file()


def test_a_full_disk_costs_one_warning(capsys, tmp_path, models, monkeypatch):
    real_write_text = type(tmp_path).write_text
    cache = tmp_path / "cache"

    def full(self, *a, **k):
        if str(self).startswith(str(cache)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, *a, **k)
    monkeypatch.setattr("pathlib.Path.write_text", full)
    real_copy = shutil.copyfile
    monkeypatch.setattr(shutil, "copyfile", lambda s, d, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")) if str(d).startswith(str(cache)) else real_copy(s, d, **k))
    caught = _relu_session_and_compile(capsys, cache, models["Relu"], tmp_path / "out")
    assert len(caught) == 1 and "No space left" in str(caught[0].message)
    assert (tmp_path / "out" / "plan.json").is_file()


def test_a_kernel_entry_is_not_served_under_another_key(tmp_path):
    cache = KernelCache(tmp_path)
    cache.get_or_build({"source": "relu"}, lambda: b"relu binary")
    [entry] = list(tmp_path.glob("??/*.pfk"))
    from powerfusion.runtime.cache import canonical_key
    sig = cache._entry_path(canonical_key({"source": "sigmoid"}).encode())
    sig.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(entry, sig)
    assert cache.get_or_build({"source": "sigmoid"}, lambda: b"sigmoid binary") == b"sigmoid binary"
    assert cache.stats.corrupt == 1


def test_a_kernel_cache_folder_that_is_a_file_builds_uncached(tmp_path):
    (tmp_path / "kernels").write_text("in the way")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert KernelCache(tmp_path / "kernels").get_or_build({"k": 1}, lambda: b"binary") == b"binary"
    assert [w.category for w in caught] == [CacheWarning]
