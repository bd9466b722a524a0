"""InferenceSession (onnxruntime-like API, feeds, CPU execution), options, and the onnx backend."""
from __future__ import annotations

import warnings
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import powerfusion
from powerfusion import options
from powerfusion.backend import PowerFusionBackend, cuda_available
from powerfusion.errors import FeedError, PowerFusionError, UnsupportedOpError
from powerfusion.basic import Conv
from powerfusion.session import BasicFallbackWarning, InferenceSession, conv_nd, onnx_type_string
from tests.session_cases import ROOT, SMALL, small_model_names, small_model_session, small_models

# float32 through decomposed Softmax and a numpy matmul: a few ulps of the reference
RTOL, ATOL = 1e-5, 1e-6


def mlp_model() -> onnx.ModelProto:
    """x[2,4] float, ids[2] int64 -> y = relu(x @ W + b), z = softmax(y), e = Gather(E, ids)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "E")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["y"], name="relu"),
             helper.make_node("Softmax", ["y"], ["z"], name="softmax", axis=-1),
             helper.make_node("Gather", ["E", "ids"], ["e"], name="gather", axis=0)]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in
         (("y", [2, 8]), ("z", [2, 8]), ("e", [2, 3]))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def sess():
    return InferenceSession(mlp_model())


def feeds():
    return {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32),
            "ids": np.array([4, 0], dtype=np.int64)}


def test_node_args(sess):
    assert [(a.name, a.shape, a.type) for a in sess.get_inputs()] == [
        ("x", [2, 4], "tensor(float)"), ("ids", [2], "tensor(int64)")]
    assert [(a.name, a.shape, a.type) for a in sess.get_outputs()] == [
        ("y", [2, 8], "tensor(float)"), ("z", [2, 8], "tensor(float)"), ("e", [2, 3], "tensor(float)")]


@pytest.mark.parametrize("dtype,expected", [(np.float32, "tensor(float)"), (np.float64, "tensor(double)"),
                                            (np.float16, "tensor(float16)"), (np.bool_, "tensor(bool)"),
                                            (np.uint8, "tensor(uint8)")])
def test_type_strings(dtype, expected):
    assert onnx_type_string(dtype) == expected


def test_run_matches_reference(sess):
    f = feeds()
    want = ReferenceEvaluator(mlp_model()).run(None, f)
    got = sess.run(None, f)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_output_names_subset_and_order(sess):
    f = feeds()
    y, z, e = sess.run(None, f)
    e2, y2 = sess.run(["e", "y"], f)
    np.testing.assert_array_equal(e2, e)
    np.testing.assert_array_equal(y2, y)
    with pytest.raises(PowerFusionError, match="unknown output name"):
        sess.run(["nope"], f)


@pytest.mark.parametrize("change,fragments", [
    (lambda f: f.pop("ids"), ["missing ['ids']", "'ids' (2,) int64"]),
    (lambda f: f.update(extra=np.zeros(1)), ["unknown ['extra']"]),
    (lambda f: f.update(x=np.zeros((3, 4), np.float32)), ["input 'x'", "expected shape (2, 4)", "given shape (3, 4)"]),
    (lambda f: f.update(x=np.zeros((2, 4), np.float64)), ["input 'x'", "dtype float32", "dtype float64"]),
    (lambda f: f.update(ids=np.array([1, 2], np.int32)), ["input 'ids'", "int64", "int32"]),
])
def test_feed_errors_name_the_input(sess, change, fragments):
    f = feeds()
    change(f)
    with pytest.raises(FeedError) as info:
        sess.run(None, f)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_model_as_path_bytes_and_proto(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    results = [InferenceSession(m).run(["z"], feeds())[0]
               for m in (str(path), path, mlp_model().SerializeToString(), mlp_model())]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_partition_and_profile(sess):
    assert sess.partition.subgraphs
    sess.run(None, feeds())
    assert len(sess.profile) == len(sess.partition.steps)
    tensors = sess.run_all_tensors(feeds())
    assert {t for sg in sess.partition.subgraphs for t in sg.outputs} | {"y", "z", "e"} <= set(tensors)


# ---- how the CPU session runs memory-bound subgraphs -------------------------------

def test_cpu_session_runs_every_subgraph_as_generated_c(sess):
    assert sess.partition.subgraphs
    assert sess.subgraph_paths == {sg.name: "c" for sg in sess.partition.subgraphs}
    assert sess.fallbacks == {}
    for k in sess.cpu_plan.kernels.values():
        assert k.native is not None and k.native.graph is k.gir and k.program is None
        assert all(t in k.subgraph.outputs for _, t in k.outputs)


def test_reference_target_runs_every_subgraph_as_rewritten_gir():
    ref = InferenceSession(mlp_model(), target="cpu-reference")
    assert ref.subgraph_paths == {sg.name: "gir" for sg in ref.partition.subgraphs}
    for k in ref.cpu_plan.kernels.values():
        assert k.program is not None and k.program.graph is k.gir and k.native is None
    for g, w in zip(ref.run(None, feeds()), ReferenceEvaluator(mlp_model()).run(None, feeds())):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_the_basic_op_executor_does_not_run(sess):
    with mock.patch("powerfusion.frontend.numpy_exec.run_basic_graph",
                    side_effect=AssertionError("the basic-op executor ran")):
        got = sess.run(None, feeds())
    for g, w in zip(got, ReferenceEvaluator(mlp_model()).run(None, feeds())):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_second_session_reuses_the_plans_without_lowering(sess):
    """Identical subgraphs are lowered once per process (plan decisions memoised by structure)."""
    with mock.patch("powerfusion.templates.merge.lower_subgraph", side_effect=AssertionError("lowered again")):
        again = InferenceSession(mlp_model())
    assert set(again.subgraph_paths.values()) == {"c"}
    for name, k in again.cpu_plan.kernels.items():
        assert k.gir.ops == sess.cpu_plan.kernels[name].gir.ops


def test_structurally_equal_models_keep_their_own_constants():
    """Plans are cached by structure, which ignores float constants' values: a second model with
    the same names and shapes but other constants must compute with its own."""
    for value in (1.0, -3.0):
        model = mlp_model()
        b = next(t for t in model.graph.initializer if t.name == "b")
        b.CopyFrom(numpy_helper.from_array(np.full(8, value, np.float32), "b"))
        got = InferenceSession(model).run(["y", "z"], feeds())
        for g, w in zip(got, ReferenceEvaluator(model).run(["y", "z"], feeds())):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_fallback_to_the_basic_op_executor_is_named_and_warned():
    from powerfusion.pipeline import choose
    from powerfusion.templates.merge import LowerError
    from powerfusion.frontend import numpy_exec
    reason = "no GIR template fits basic op n0 (for this test)"
    with mock.patch.object(choose, "choose_default", side_effect=LowerError(reason)):
        with pytest.warns(BasicFallbackWarning, match="runs on the basic-op executor, not as GIR: LowerError: no GIR"):
            s = InferenceSession(mlp_model())
    assert set(s.subgraph_paths.values()) == {"basic"}
    assert s.fallbacks and all(r == f"LowerError: {reason}" for r in s.fallbacks.values())
    with mock.patch.object(numpy_exec, "run_basic_graph", wraps=numpy_exec.run_basic_graph) as basic:
        got = s.run(None, feeds())
    assert basic.call_count == len(s.partition.subgraphs)
    for g, w in zip(got, ReferenceEvaluator(mlp_model()).run(None, feeds())):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", small_model_names())
def test_committed_model_matches_onnxruntime(name):
    """float32 through the CPU session: max |diff| / max |onnxruntime| < 1e-4 (our reductions and
    numpy's matmul sum in a different order than onnxruntime), every subgraph as generated C."""
    import sys
    sys.path.insert(0, str(ROOT))
    from models.onnx_tools import run_onnxruntime
    sess, f = small_model_session(name)
    assert set(sess.subgraph_paths.values()) == {"c"}, sess.fallbacks
    want = run_onnxruntime(onnx.load(SMALL / small_models()[name]["file"]), f)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, f)))
    for out, ref in want.items():
        assert got[out].shape == ref.shape and got[out].dtype == ref.dtype, out
        err = float(np.max(np.abs(got[out].astype(np.float64) - ref))) / max(float(np.max(np.abs(ref))), 1e-30)
        assert err < 1e-4, f"{name}.{out}: relative error {err:.2e}"


def compute_bound_model() -> onnx.ModelProto:
    """Conv then MatMul, both large enough to be library calls on the CPU target."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1, "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "cb"),
             numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32) * 0.1, "W")]
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Reshape", ["c", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "W"], ["y"], name="mm")]
    inits.append(numpy_helper.from_array(np.array([128, 256], np.int64), "shape"))
    graph = helper.make_graph(nodes, "convmm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 256])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_library_calls_match_reference():
    model = compute_bound_model()
    s = InferenceSession(model)
    assert sorted(type(c.node.op).__name__ for c in s.partition.library_calls) == ["Conv", "MatMul"]
    x = np.random.default_rng(3).standard_normal((1, 16, 32, 32)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_unsupported_op_is_named():
    node = helper.make_node("Det", ["x"], ["y"], name="the_det")
    graph = helper.make_graph([node], "det", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(UnsupportedOpError, match="the_det.*Det"):
        InferenceSession(model)


def test_targets_that_cannot_run_here():
    with pytest.raises(PowerFusionError, match="unknown target"):
        InferenceSession(mlp_model(), target="tpu")
    with pytest.raises(PowerFusionError, match="cannot|not"):
        InferenceSession(mlp_model(), target="hip")
    if not cuda_available():
        with pytest.raises(PowerFusionError, match="(?i)cuda.*(not available|needs cupy)"):
            InferenceSession(mlp_model(), target="cuda")


# ---- conv through im2col, against onnx's reference implementation ---------------

CONV_CASES = [  # (spatial dims, group, strides, dilations, pads per side)
    (2, 1, (1, 1), (1, 1), (1, 1)),
    (2, 2, (2, 1), (1, 2), (0, 2)),
    (1, 3, (2,), (2,), (1,)),
    (3, 1, (1, 2, 1), (1, 1, 2), (1, 0, 1)),
    (2, 4, (1, 1), (1, 1), (1, 1)),  # depthwise-like: one input channel per group... times 2
]


@pytest.mark.parametrize("nsp,group,strides,dilations,pads", CONV_CASES)
def test_conv_im2col(nsp, group, strides, dilations, pads):
    rng = np.random.default_rng(nsp * 10 + group)
    n, c, m = 2, group * 2, group * 3
    x = rng.standard_normal((n, c) + (7,) * nsp).astype(np.float32)
    w = rng.standard_normal((m, c // group) + (3,) * nsp).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=group, strides=list(strides),
                            dilations=list(dilations), pads=list(pads) * 2)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info(k, TensorProto.FLOAT, None)
                                               for k in "xwb"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    want = ReferenceEvaluator(helper.make_model(graph)).run(None, {"x": x, "w": w, "b": b})[0]
    got = conv_nd(x, w, b, Conv(strides, pads, pads, dilations, group))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- options ---------------------------------------------------------------------

def test_options_context_nests_and_restores():
    before = options.current()
    with options.context(verbose=2, target="cuda") as inner:
        assert options.current() is inner and inner.verbose == 2 and inner.target == "cuda"
        with options.context(verbose=0):
            assert options.current().verbose == 0 and options.current().target == "cuda"
        assert options.current().verbose == 2
    assert options.current() == before


def test_options_reject_unknown_names():
    with pytest.raises(PowerFusionError, match="unknown option"):
        with options.context(no_such_setting=1):
            pass


def test_options_from_environment():
    env = {"POWERFUSION_CACHE_DIR": "/some/where", "POWERFUSION_VERBOSE": "2", "POWERFUSION_TARGET": "cuda"}
    opts = options._from_environment(env)
    assert (str(opts.cache_dir), opts.verbose, opts.target) == ("/some/where", 2, "cuda")
    with pytest.raises(PowerFusionError, match="POWERFUSION_VERBOSE"):
        options._from_environment({"POWERFUSION_VERBOSE": "loud"})


def test_session_options_override_defaults():
    s = InferenceSession(mlp_model(), options={"verbose": 2})
    assert s.options.verbose == 2 and options.current().verbose != 2 or options.current().verbose == 2


def test_top_level_exports():
    assert powerfusion.InferenceSession is InferenceSession
    assert issubclass(powerfusion.FeedError, powerfusion.PowerFusionError)


# ---- the onnx backend ------------------------------------------------------------

def test_backend_devices_and_run_node():
    assert PowerFusionBackend.supports_device("CPU")
    assert PowerFusionBackend.supports_device("CUDA") == cuda_available()
    node = helper.make_node("Relu", ["x"], ["y"])
    x = np.array([[-1.0, 2.0], [3.0, -4.0]], np.float32)
    (y,) = PowerFusionBackend.run_node(node, [x])
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    (y,) = PowerFusionBackend.run_node(node, [x], outputs_info=[(np.float32, (2, 2))])
    np.testing.assert_array_equal(y, np.maximum(x, 0))


BACKEND_CASES = ("test_relu", "test_add_bcast", "test_matmul_2d", "test_conv_with_strides_padding",
                 "test_softmax_axis_1", "test_transpose_default", "test_concat_2d_axis_0",
                 "test_gemm_default_no_bias", "test_averagepool_2d_default")


def _backend_test_cases() -> dict:
    """onnx's BackendTest over a few node cases (it reads them in memory from onnx's case list)."""
    import re

    import onnx.backend.test
    from onnx.backend.test import loader, runner

    def node_cases_only(kind, **kwargs):  # the on-disk kinds are old-opset models we decline
        return loader.load_model_tests(kind=kind) if kind == "node" else []

    with mock.patch.object(runner, "load_model_tests", node_cases_only), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        suite = onnx.backend.test.BackendTest(PowerFusionBackend, __name__)
    pattern = re.compile(r"^(%s)_cpu$" % "|".join(BACKEND_CASES))
    suite.include(pattern.pattern)
    classes = suite.test_cases
    for cls in classes.values():  # keep only the chosen cases, rather than thousands of skips
        for attr in [a for a in vars(cls) if a.startswith("test_") and not pattern.match(a)]:
            delattr(cls, attr)
    assert sum(a.startswith("test_") for c in classes.values() for a in vars(c)) == len(BACKEND_CASES)
    return classes


globals().update(_backend_test_cases())


def test_fallback_summary_collapses_repeated_reasons():
    from powerfusion.session import fallback_summary
    why = {f"attn{i}": "Attention through cuBLAS + CuPy (not captured): bias of shape (8, 1, 128, 128)"
           for i in range(12)}
    why.update({"conv0": "Conv through im2col + cuBLAS: a", "conv1": "Conv through im2col + cuBLAS: b",
                "conv2": "Conv through im2col + cuBLAS: c"})
    line = fallback_summary(why, 40)
    assert line.startswith("15 of 40 library calls run off their fast route")
    assert "12 x Attention through cuBLAS + CuPy (not captured): bias of shape (8, 1, 128, 128)" in line
    assert line.count(" x ") == 3 and line.endswith("1 more reasons")


@pytest.mark.gpu
def test_a_cuda_session_warns_when_library_calls_fall_back(monkeypatch):
    """cuDNN switched off: the conv runs on im2col + cuBLAS, and the build says so once."""
    from powerfusion.backends.cuda import cudnn_conv
    from powerfusion.session import LibraryFallbackWarning
    monkeypatch.setattr(cudnn_conv, "load", lambda: (None, "switched off by the test"))
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(LibraryFallbackWarning, match="1 of 1 library calls run off their fast route"):
        sess = InferenceSession(model.SerializeToString(), target="cuda")
    assert list(sess.fallbacks.values()) == ["Conv through im2col + cuBLAS: switched off by the test"]
