"""`powerfusion compile` results cached on disk (powerfusion.compile_cache): a repeated compile
is a hit, and every change that could change the output is a miss or a repair."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import powerfusion.cli as cli
from powerfusion import compile_cache


def model(bias: np.ndarray) -> onnx.ModelProto:
    """x + bias -> Softmax, and MatMul(x, W): one memory-bound subgraph that reads a constant
    (written as a .npy file) and one library call."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(bias, "bias"),
             numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W")]
    nodes = [helper.make_node("Add", ["x", "bias"], ["a"], name="add"),
             helper.make_node("Softmax", ["a"], ["y"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["x", "W"], ["z"], name="mm")]
    graph = helper.make_graph(nodes, "cached", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


BIAS = np.linspace(-1, 1, 64, dtype=np.float32)


def compile_(capsys, cache, model_path, out, *extra):
    code = cli.main(["--cache-dir", str(cache), "compile", str(model_path), "-o", str(out), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.err


def folder(out) -> dict[str, bytes]:
    """Every output file's bytes (plan.json without its timings, which differ between compiles)."""
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != compile_cache.STAMP}
    files["plan.json"] = json.dumps(plan_json_without_timings(out)).encode()
    if "artefact.json" in files:   # it hashes plan.json, whose timings differ: compare the rest
        manifest = json.loads(files["artefact.json"])
        manifest["files"].pop("plan.json")
        files["artefact.json"] = json.dumps(manifest).encode()
    return files


def plan_json_without_timings(out) -> dict:
    doc = json.loads((out / "plan.json").read_text())
    doc.pop("timings_s")
    return doc


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model(BIAS), path)
    return path


def test_second_compile_is_a_hit_and_leaves_the_folder_alone(capsys, tmp_path, model_path):
    out = tmp_path / "out"
    err = compile_(capsys, tmp_path / "cache", model_path, out)
    assert "cached compile" not in err
    first = folder(out)
    assert "plan.json" in first and any(n.endswith(".cu") for n in first)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    err = compile_(capsys, tmp_path / "cache", model_path, out)
    assert "cached compile" in err and "up to date" in err
    assert folder(out) == first
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_hit_into_a_new_folder_restores_every_file(capsys, tmp_path, model_path):
    compile_(capsys, tmp_path / "cache", model_path, tmp_path / "a")
    err = compile_(capsys, tmp_path / "cache", model_path, tmp_path / "b")
    assert "restored" in err
    assert folder(tmp_path / "b") == folder(tmp_path / "a")


def test_changed_model_is_a_miss(capsys, tmp_path, model_path):
    out = tmp_path / "out"
    compile_(capsys, tmp_path / "cache", model_path, out)
    before = folder(out)
    onnx.save(model(BIAS * 2), model_path)
    err = compile_(capsys, tmp_path / "cache", model_path, out)
    assert "cached compile" not in err
    after = folder(out)
    changed = [n for n in after if n.endswith(".npy") and after[n] != before.get(n)]
    assert changed, "the new bias must reach the constant files"


def test_other_options_are_a_miss(capsys, tmp_path, model_path):
    compile_(capsys, tmp_path / "cache", model_path, tmp_path / "cuda")
    err = compile_(capsys, tmp_path / "cache", model_path, tmp_path / "hip", "--target", "hip")
    assert "cached compile" not in err
    assert any(p.suffix == ".hip" for p in (tmp_path / "hip").iterdir())


def test_no_cache_compiles_again(capsys, tmp_path, model_path):
    compile_(capsys, tmp_path / "cache", model_path, tmp_path / "out")
    err = compile_(capsys, tmp_path / "cache", model_path, tmp_path / "out", "--no-cache")
    assert "cached compile" not in err
    assert "subgraph" in err   # the search's progress lines


def test_output_file_edited_in_place_is_repaired(capsys, tmp_path, model_path):
    out = tmp_path / "out"
    compile_(capsys, tmp_path / "cache", model_path, out)
    want = plan_json_without_timings(out)
    with open(out / "plan.json", "r+b") as f:   # in place: the entry may share this file's inode
        f.seek(0)
        f.write(b"{ broken")
    compile_(capsys, tmp_path / "cache", model_path, out)
    assert plan_json_without_timings(out) == want


def test_corrupted_entry_is_detected_and_rebuilt(capsys, tmp_path, model_path):
    cache = tmp_path / "cache"
    compile_(capsys, cache, model_path, tmp_path / "a")
    want = plan_json_without_timings(tmp_path / "a")
    [entry] = compile_cache.entries(cache)
    source = next(p for p in entry.iterdir() if p.suffix == ".cu")
    os.unlink(source)                     # break the link first: leave folder a intact
    source.write_text("garbage")
    err = compile_(capsys, cache, model_path, tmp_path / "b")
    assert "cached compile" not in err   # detected: compiled again
    assert folder(tmp_path / "b") == folder(tmp_path / "a")
    assert plan_json_without_timings(tmp_path / "b") == want
    assert "restored" in compile_(capsys, cache, model_path, tmp_path / "c")   # the rebuilt entry serves


def test_truncated_entry_json_is_a_miss(capsys, tmp_path, model_path):
    cache = tmp_path / "cache"
    compile_(capsys, cache, model_path, tmp_path / "a")
    [entry] = compile_cache.entries(cache)
    text = (entry / compile_cache.ENTRY).read_text()
    (entry / compile_cache.ENTRY).write_text(text[: len(text) // 2])
    err = compile_(capsys, cache, model_path, tmp_path / "b")
    assert "cached compile" not in err
    assert (tmp_path / "b" / "plan.json").is_file()


def test_entry_naming_a_path_outside_is_rejected(tmp_path):
    info = {"format": compile_cache.FORMAT, "summary": {}, "external_data": [],
            "files": {"../escape": {"size": 1, "sha256": "0" * 64}}}
    assert not compile_cache._well_formed(info)


def test_external_data_change_is_a_miss(capsys, tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(model(BIAS), path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    data = tmp_path / "ext.data"
    assert data.is_file()
    out = tmp_path / "out"
    compile_(capsys, tmp_path / "cache", path, out)
    before = folder(out)
    assert "cached compile" in compile_(capsys, tmp_path / "cache", path, out)
    # rewrite the bias inside the data file, same size: the model file itself is unchanged
    raw = bytearray(data.read_bytes())
    offset = raw.find(BIAS.tobytes())
    assert offset >= 0
    raw[offset:offset + BIAS.nbytes] = (BIAS * 3).tobytes()
    data.write_bytes(bytes(raw))
    err = compile_(capsys, tmp_path / "cache", path, out)
    assert "cached compile" not in err
    assert folder(out) != before
    assert "cached compile" in compile_(capsys, tmp_path / "cache", path, out)   # stored again


def test_missing_external_data_names_the_file(capsys, tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(model(BIAS), path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    os.unlink(tmp_path / "weights.bin")
    code = cli.main(["-q", "--cache-dir", str(tmp_path / "cache"), "compile", str(path), "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "weights.bin" in err and "does not exist" in err


def test_cache_status_and_clear_count_compile_results(capsys, tmp_path, model_path):
    cache = tmp_path / "cache"
    compile_(capsys, cache, model_path, tmp_path / "a")
    assert cli.main(["--cache-dir", str(cache), "cache", "status"]) == 0
    assert "compile results: 1" in capsys.readouterr().out
    assert cli.main(["--cache-dir", str(cache), "cache", "clear"]) == 0
    assert "removed 1 cached compile result" in capsys.readouterr().out
    assert compile_cache.entries(cache) == []


def test_eviction_keeps_the_most_recent(tmp_path):
    base = compile_cache.root(tmp_path)
    for k, age in (("old", 100), ("new", 0)):
        d = base / k
        d.mkdir(parents=True)
        (d / "blob").write_bytes(b"x" * 1000)
        (d / compile_cache.ENTRY).write_text("{}")
        os.utime(d / compile_cache.ENTRY, (1e9 - age, 1e9 - age))
    assert compile_cache.evict(tmp_path, max_bytes=1500) == 1
    assert [p.name for p in compile_cache.entries(tmp_path)] == ["new"]
