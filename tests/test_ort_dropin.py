"""A script written for onnxruntime runs with only its import swapped to powerfusion.

The script is run first with onnxruntime itself (so it is a real onnxruntime script) and then
with `import powerfusion as ort`; their results must agree (float32: rtol 1e-5, atol 1e-6,
a few ulps of a decomposed Softmax; integers exactly). The CUDA variant binds CuPy buffers.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import powerfusion
from powerfusion.errors import FeedError, PowerFusionError
from tests.test_session import feeds, mlp_model

RTOL, ATOL = 1e-5, 1e-6

CPU_SCRIPT = '''
import numpy as np
import {module} as ort

so = ort.SessionOptions()
so.log_severity_level = 3
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.intra_op_num_threads = 1
sess = ort.InferenceSession(MODEL, sess_options=so, providers=["CPUExecutionProvider"])
assert "CPUExecutionProvider" in ort.get_available_providers()
assert sess.get_providers() == ["CPUExecutionProvider"]
meta = sess.get_modelmeta()
result["graph_name"] = meta.graph_name
inputs = {{i.name: (i.shape, i.type) for i in sess.get_inputs()}}
result["inputs"] = inputs
x = np.random.default_rng(1).standard_normal(inputs["x"][0]).astype(np.float32)
feed = {{"x": x, "ids": [4, 0]}}                        # a list feed, converted to int64
result["all"] = sess.run(None, feed)
result["empty"] = sess.run([], feed)
result["named"] = sess.run(["z"], feed, ort.RunOptions())
binding = sess.io_binding()
binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x, "cpu", 0))
binding.bind_cpu_input("ids", np.array([4, 0], dtype=np.int64))
binding.bind_output("y", "cpu")
out_z = np.empty((2, 8), np.float32)
binding.bind_output("z", "cpu", 0, np.float32, out_z.shape, out_z.ctypes.data)
sess.run_with_iobinding(binding)
result["bound"] = binding.copy_outputs_to_cpu()
result["bound_z_buffer"] = out_z.copy()
'''


def _run_script(source: str, model_bytes: bytes) -> dict:
    result: dict = {}
    exec(compile(source, "<onnxruntime script>", "exec"), {"MODEL": model_bytes, "result": result})
    return result


def _assert_same(ours, theirs):
    if isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _assert_same(a, b)
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)
    else:
        assert ours == theirs


def test_onnxruntime_script_runs_with_the_import_swapped():
    pytest.importorskip("onnxruntime")
    model = mlp_model().SerializeToString()
    theirs = _run_script(CPU_SCRIPT.format(module="onnxruntime"), model)
    ours = _run_script(CPU_SCRIPT.format(module="powerfusion"), model)
    assert set(ours) == set(theirs)
    for key in theirs:
        _assert_same(ours[key], theirs[key])
    assert len(ours["empty"]) == 3   # run([]) returns every output, as onnxruntime does


def test_providers_and_options_map_to_targets():
    so = powerfusion.SessionOptions()
    so.log_severity_level = 0
    so.graph_optimization_level = powerfusion.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = powerfusion.InferenceSession(mlp_model(), so, ["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert sess.target == "cpu"
    assert sess.options.verbose == 2 and sess.options.search_budget_s == 0.0
    with pytest.raises(PowerFusionError, match="unknown execution provider"):
        powerfusion.InferenceSession(mlp_model(), providers=["NoSuchExecutionProvider"])
    with pytest.raises(PowerFusionError, match="unknown setting"):
        so.no_such_setting = 1
    with pytest.raises(PowerFusionError, match="name the target"):
        powerfusion.InferenceSession(mlp_model(), "cpu")
    with pytest.raises(PowerFusionError, match="disagree"):
        powerfusion.InferenceSession(mlp_model(), providers=["CUDAExecutionProvider"], target="cpu")
    with pytest.raises(PowerFusionError, match="unknown keyword"):
        powerfusion.InferenceSession(mlp_model(), sess_option=so)


def test_existing_target_and_options_keywords_still_work():
    sess = powerfusion.InferenceSession(mlp_model(), target="cpu", options={"verbose": 0})
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert len(sess.run(None, feeds())) == 3


def test_feed_errors_name_the_input():
    sess = powerfusion.InferenceSession(mlp_model())
    with pytest.raises(FeedError, match="input 'x'.*float64"):
        sess.run(None, {"x": np.zeros((2, 4)), "ids": [1, 2]})
    with pytest.raises(PowerFusionError, match="unknown output"):
        sess.run(["nope"], feeds())


def test_concurrent_runs_on_one_cpu_session_agree():
    sess = powerfusion.InferenceSession(mlp_model())
    want = sess.run(None, feeds())
    errors, results = [], []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(5):
                x = rng.standard_normal((2, 4)).astype(np.float32)
                got = sess.run(["y"], {"x": x, "ids": np.array([4, 0], np.int64)})[0]
                results.append(np.allclose(got, np.maximum(x @ _weights(sess) + _bias(sess), 0), RTOL, ATOL))
        except Exception as e:   # surfaced below: a thread's exception would vanish otherwise
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20 and all(results)
    _assert_same(sess.run(None, feeds()), want)


def _weights(sess):
    return np.asarray(sess.graph.constants["W"], np.float32)


def _bias(sess):
    return np.asarray(sess.graph.constants["b"], np.float32)


CUDA_SCRIPT = '''
import numpy as np
import cupy
import {module} as ort

sess = ort.InferenceSession(MODEL, providers=[("CUDAExecutionProvider", {{"device_id": 0}}), "CPUExecutionProvider"])
x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
result["all"] = sess.run(None, {{"x": x, "ids": np.array([4, 0], np.int64)}})
x_gpu = cupy.asarray(x)
ids_gpu = ort.OrtValue.ortvalue_from_numpy(np.array([4, 0], np.int64), "cuda", 0)
z_gpu = cupy.empty((2, 8), np.float32)
binding = sess.io_binding()
binding.bind_input("x", "cuda", 0, np.float32, x_gpu.shape, x_gpu.data.ptr)
binding.bind_ortvalue_input("ids", ids_gpu)
binding.bind_output("y", "cuda")
binding.bind_output("z", "cuda", 0, np.float32, z_gpu.shape, z_gpu.data.ptr)
sess.run_with_iobinding(binding)
outs = binding.get_outputs()
result["device_names"] = [o.device_name() for o in outs]
result["bound"] = binding.copy_outputs_to_cpu()
result["z_buffer"] = cupy.asnumpy(z_gpu)
'''


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_onnxruntime_cuda_script_with_device_buffers(cuda_graph):
    model = mlp_model().SerializeToString()
    want = powerfusion.InferenceSession(model).run(None, feeds())
    with powerfusion.options.context(cuda_graph=cuda_graph):
        ours = _run_script(CUDA_SCRIPT.format(module="powerfusion"), model)
    _assert_same(ours["all"], want)
    assert ours["device_names"] == ["cuda", "cuda"]
    _assert_same(ours["bound"], want[:2])
    np.testing.assert_allclose(ours["z_buffer"], want[1], rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
def test_cuda_session_reads_torch_and_cupy_inputs_in_place():
    import cupy
    sess = powerfusion.InferenceSession(mlp_model(), target="cuda")
    want = powerfusion.InferenceSession(mlp_model()).run(None, feeds())
    f = feeds()
    got = sess.run(None, {"x": cupy.asarray(f["x"]), "ids": cupy.asarray(f["ids"])})
    _assert_same(got, want)
    torch = pytest.importorskip("torch")
    got = sess.run(None, {"x": torch.from_numpy(f["x"]).cuda(), "ids": torch.from_numpy(f["ids"]).cuda()})
    _assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_concurrent_runs_on_one_cuda_session(cuda_graph):
    """Eight threads, each with its own inputs, on one session: the session's lock keeps the
    shared arena consistent, so every result is that thread's own."""
    import cupy
    sess = powerfusion.InferenceSession(mlp_model(), target="cuda", options={"cuda_graph": cuda_graph})
    cpu = powerfusion.InferenceSession(mlp_model())
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                f = {"x": rng.standard_normal((2, 4)).astype(np.float32), "ids": np.array([seed % 5, 0], np.int64)}
                with cupy.cuda.Stream(non_blocking=True):
                    got = sess.run(None, {"x": cupy.asarray(f["x"]), "ids": f["ids"]})
                _assert_same(got, cpu.run(None, f))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
