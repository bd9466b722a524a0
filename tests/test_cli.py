"""The `powerfusion` command line: inspect, run, compare, the subcommand table and error paths."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import powerfusion.cli as cli
import powerfusion.session


def conv_mlp_model() -> onnx.ModelProto:
    """x -> Conv -> Relu -> Reshape -> MatMul -> Softmax, plus ids -> Gather: library calls with
    memory-bound subgraphs between them, and an integer input that indexes a table."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1, "w"),
             numpy_helper.from_array(np.array([128, 256], np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32) * 0.1, "W"),
             numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "E")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "shape"], ["flat"], name="reshape"),
             helper.make_node("MatMul", ["flat", "W"], ["m"], name="mm"),
             helper.make_node("Softmax", ["m"], ["y"], name="softmax", axis=-1),
             helper.make_node("Gather", ["E", "ids"], ["e"], name="gather", axis=0)]
    graph = helper.make_graph(
        nodes, "conv_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 32, 32]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 256]),
         helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "conv_mlp.onnx"
    onnx.save(conv_mlp_model(), path)
    return str(path)


@pytest.fixture(scope="module")
def unsupported_path(tmp_path_factory):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="ok"), helper.make_node("Det", ["r"], ["y"], name="the_det")]
    graph = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    path = tmp_path_factory.mktemp("models") / "det.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return str(path)


def run_cli(capsys, *argv):
    code = cli.main(["-q", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_text(capsys, model_path):
    code, out, err = run_cli(capsys, "inspect", model_path)
    assert code == 0, err
    assert "Conv x1" in out and "MatMul x1" in out and "Softmax x1" in out
    assert "2 library call(s)" in out
    assert "Conv from Conv 'conv'" in out and "MatMul from MatMul 'mm'" in out


def test_inspect_json_has_costs(capsys, model_path):
    code, out, _ = run_cli(capsys, "inspect", model_path, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["ops"]["Conv"] == 1 and report["unsupported"] == []
    assert [i["name"] for i in report["inputs"]] == ["x", "ids"]
    library = [s for s in report["steps"] if s["kind"] == "library"]
    assert sorted(s["op"] for s in library) == ["Conv", "MatMul"]
    conv = next(s for s in library if s["op"] == "Conv")
    assert conv["flops"] == 2 * 32 * 16 * 9 * 32 * 32  # multiply-adds of a 3x3 conv, stride 1, same padding
    assert conv["bytes"] == 4 * (16 * 32 * 32 + 32 * 16 * 9 + 32 * 32 * 32)
    assert conv["intensity"] == pytest.approx(conv["flops"] / conv["bytes"], rel=1e-3)
    assert all(s["bytes"] > 0 for s in report["steps"] if s["kind"] == "subgraph")


def test_inspect_names_unsupported_ops(capsys, unsupported_path):
    code, out, err = run_cli(capsys, "inspect", unsupported_path)
    assert code == 2
    assert "UNSUPPORTED" in out and "the_det" in out and "Det" in out
    assert "error" in err and "Traceback" not in err
    code, out, _ = run_cli(capsys, "inspect", unsupported_path, "--json")
    assert code == 2 and json.loads(out)["unsupported"][0]["op_type"] == "Det"


def test_run_is_seeded_and_writes_outputs(capsys, model_path, tmp_path):
    out1, out2, out3 = (tmp_path / f"o{k}.npz" for k in range(3))
    for path, seed in ((out1, "3"), (out2, "3"), (out3, "4")):
        code, out, err = run_cli(capsys, "run", model_path, "--seed", seed, "--output", str(path))
        assert code == 0, err
    assert "y: shape (128, 256) float32" in out and "e: shape (4, 3) float32" in out
    a, b, c = (np.load(p) for p in (out1, out2, out3))
    assert sorted(a.files) == ["e", "y"]
    np.testing.assert_array_equal(a["y"], b["y"])
    assert not np.array_equal(a["y"], c["y"])
    # softmax rows sum to one: the numbers are real, not placeholders
    np.testing.assert_allclose(a["y"].sum(axis=-1), 1.0, rtol=1e-5)


def test_run_with_inputs_file(capsys, model_path, tmp_path):
    x = np.random.default_rng(9).standard_normal((1, 16, 32, 32)).astype(np.float32)
    ids = np.array([4, 3, 0, 1], np.int64)
    np.savez(tmp_path / "in.npz", x=x, ids=ids)
    code, _, err = run_cli(capsys, "run", model_path, "--inputs", str(tmp_path / "in.npz"),
                           "--output", str(tmp_path / "out.npz"))
    assert code == 0, err
    want = powerfusion.session.InferenceSession(model_path).run(None, {"x": x, "ids": ids})
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(got["y"], want[0])
    np.testing.assert_array_equal(got["e"], want[1])


def test_random_integer_inputs_stay_in_gather_range():
    from powerfusion.cli.common import random_inputs
    sess = powerfusion.session.InferenceSession(conv_mlp_model())
    for seed in range(5):
        ids = random_inputs(sess.graph, seed)["ids"]
        assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 5


def test_compare_passes_against_onnxruntime(capsys, model_path):
    pytest.importorskip("onnxruntime")
    code, out, err = run_cli(capsys, "compare", model_path)
    assert code == 0, out + err
    assert "2/2 tensors within tolerance" in out


def test_compare_per_subgraph_adds_intermediates(capsys, model_path):
    pytest.importorskip("onnxruntime")
    code, out, err = run_cli(capsys, "compare", model_path, "--per-subgraph")
    assert code == 0, out + err
    rows = [line.split() for line in out.splitlines() if line.startswith("sg")]
    # "flat" (Reshape's output) leaves the Relu/Reshape subgraph for the MatMul library call
    assert "flat" in {r[1] for r in rows} and all(r[-1] == "pass" for r in rows)
    total = int(out.strip().splitlines()[-1].split("/")[1].split()[0])
    assert total == 2 + len(rows)


def test_compare_detects_wrong_numbers(capsys, model_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    real = powerfusion.session.run_library_op

    def off_by_a_bit(op, inputs, out_dtype):
        return (real(op, inputs, out_dtype) * 1.01).astype(out_dtype)

    monkeypatch.setattr(powerfusion.session, "run_library_op", off_by_a_bit)
    # the cpu target's planned-buffer runners would bypass run_library_op: none, so it runs
    monkeypatch.setattr("powerfusion.backends.cpu.library.library_runner", lambda node, graph: None)
    # nor may the whole-model C driver, which calls the BLAS itself: every step per step
    monkeypatch.setattr("powerfusion.backends.cpu.driver.plan_runs", lambda partition, plan: (None, {}))
    code, out, _ = run_cli(capsys, "compare", model_path)
    assert code == 1 and "FAIL" in out


def test_compare_without_onnxruntime_says_so_before_any_work(capsys, model_path, monkeypatch):
    import sys
    import powerfusion.cli.common as common
    monkeypatch.setitem(sys.modules, "onnxruntime", None)    # import onnxruntime -> ImportError
    monkeypatch.setattr(common, "make_session", lambda *a, **k: pytest.fail("work started before the check"))
    code, _, err = run_cli(capsys, "compare", model_path)
    assert code == 2 and "powerfusion[ort]" in err


def test_compare_prints_full_tensor_names(capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    long = "/bert/encoder/layer.0/attention/self/Softmax_output_0"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Relu", ["x"], [long]), helper.make_node("Neg", [long], ["y"])]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                                                 helper.make_tensor_value_info(long, TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "long.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    code, out, err = run_cli(capsys, "compare", str(path))
    assert code == 0, out + err
    assert long in out


def test_global_flags_after_the_subcommand(capsys, model_path):
    assert cli.main(["run", model_path, "-q"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["run", model_path, "-v"]) == 0
    assert "[powerfusion] import:" in capsys.readouterr().err    # -v: build steps with their timings


def test_python_dash_m_powerfusion():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "powerfusion", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("powerfusion ")


def test_bundled_models_resolve_by_name(capsys):
    code, out, err = run_cli(capsys, "inspect", "sardrn_small")
    assert code == 0, err
    assert "sardrn_small.onnx" in out


@pytest.mark.parametrize("argv,fragment", [
    (["run", "no/such/model.onnx"], "does not exist"),
    (["inspect", "no/such/model.onnx"], "does not exist"),
    (["run", "{model}", "--inputs", "no/such/in.npz"], "does not exist"),
    (["run", "{model}", "--shapes", "x:1xbad"], "bad --shapes entry"),
    (["run", "{model}", "--target", "tpu"], "unknown target"),
])
def test_user_errors_exit_2_with_one_paragraph(capsys, model_path, argv, fragment):
    code, out, err = run_cli(capsys, *[a.format(model=model_path) for a in argv])
    assert code == 2
    assert fragment in err and err.startswith("powerfusion ") and "Traceback" not in err


def test_wrong_feed_file_names_the_input(capsys, model_path, tmp_path):
    np.savez(tmp_path / "bad.npz", x=np.zeros((1, 16, 32, 32), np.float64), ids=np.zeros(4, np.int64))
    code, _, err = run_cli(capsys, "run", model_path, "--inputs", str(tmp_path / "bad.npz"))
    assert code == 2 and "input 'x'" in err and "float64" in err


def test_no_traceback_in_a_real_process(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a model")
    proc = subprocess.run([sys.executable, "-m", "powerfusion.cli", "run", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error" in proc.stderr and "Traceback" not in proc.stderr and proc.stdout == ""


def test_subcommand_registration_is_one_line(capsys, monkeypatch):
    module = types.ModuleType("pf_test_hello")
    module.HELP = "say hello"
    module.add_arguments = lambda p: p.add_argument("--name", default="world")
    module.main = lambda args: print(f"hello {args.name}") or 0
    monkeypatch.setitem(sys.modules, "pf_test_hello", module)
    monkeypatch.setitem(cli.SUBCOMMANDS, "hello", "pf_test_hello")  # the one line
    assert cli.main(["hello", "--name", "pf"]) == 0
    assert capsys.readouterr().out == "hello pf\n"


def test_planned_subcommands_missing_module_is_left_out(monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "later", "powerfusion.cli.cmd_not_written_yet")
    parser = cli.build_parser()
    assert "later" not in parser.format_help()
    assert "inspect" in parser.format_help()


def test_compile_jobs_reach_the_search(capsys, model_path, tmp_path, monkeypatch):
    """`-j N` sets the search workers the pipeline uses (it was once set where the command's own
    settings context did not see it, and ignored)."""
    import powerfusion.pipeline.driver as driver
    seen = []
    real = driver.search_all

    def spy(subs, graph, t, *, workers, **kw):
        seen.append(workers)
        return real(subs, graph, t, workers=workers, **kw)

    monkeypatch.setattr(driver, "search_all", spy)
    code, _, err = run_cli(capsys, "compile", model_path, "-o", str(tmp_path / "out"), "-j", "1", "--no-cache")
    assert code == 0, err
    assert seen == [1]
