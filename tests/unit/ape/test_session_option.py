"""The session option `fp32_matmul` and the CLI's `--fp32-matmul`: validation and parsing on
the CPU; on a GPU, fp32 MatMul / Gemm / Conv of small models run through Ape in each mode,
checked against float64 and checked to have been routed.

Error measure, as in docs/ape.md: max over outputs of |Y - Y64| / (|A| |B| (+ |bias|)), the
products taken in float64. Tolerances are about 5x the errors docs/ape.md measured at 1024^3
on an H100 (SGEMM 3.3e-7, FP32-F 4.0e-7, FP32-T 7.3e-7, FP32-B 3.1e-7); these models' K is
at most 576, so their accumulation error is smaller still. A TF32 GEMM (7e-5 there) or a
plain fp16 one fails all of them."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from powerfusion import options
from powerfusion.errors import PowerFusionError
from powerfusion.options import FP32_MATMUL_MODES

TOLERANCE = {"fp32": 2e-6, "auto": 2e-6, "fp32-f": 2e-6, "fp32-t": 4e-6, "fp32-b": 2e-6}
APE_MODES = ("auto", "fp32-f", "fp32-t", "fp32-b")


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def matmul_model(a_shape, b_shape, y_shape) -> onnx.ModelProto:
    return _model([helper.make_node("MatMul", ["a", "b"], ["y"])],
                  [_f32("a", a_shape), _f32("b", b_shape)], [_f32("y", y_shape)])


def gemm_model(w: np.ndarray, bias: np.ndarray, m: int) -> onnx.ModelProto:
    """Y = X W^T + bias (transB = 1), W and bias constants, as a Linear layer exports."""
    n, k = w.shape
    inits = [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(bias, "c")]
    return _model([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)],
                  [_f32("x", (m, k))], [_f32("y", (m, n))], inits)


def conv_model(x_shape, w: np.ndarray, bias: np.ndarray) -> onnx.ModelProto:
    n, _, h, wd = x_shape
    inits = [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(bias, "c")]
    return _model([helper.make_node("Conv", ["x", "w", "c"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])],
                  [_f32("x", x_shape)], [_f32("y", (n, w.shape[0], h, wd))], inits)


# ---- CPU: the option and the flag ------------------------------------------------------

def test_modes_are_apes():
    from powerfusion import ape
    assert set(FP32_MATMUL_MODES) == set(ape.MODES)
    assert options.current().fp32_matmul == "fp32"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_unknown_mode_is_refused_naming_the_allowed_ones(target):
    from powerfusion import InferenceSession
    model = matmul_model((4, 8), (8, 3), (4, 3))
    with pytest.raises(PowerFusionError) as e:   # refused before the target is looked at
        InferenceSession(model, target=target, options={"fp32_matmul": "tf32"})
    for mode in FP32_MATMUL_MODES:
        assert repr(mode) in str(e.value)
    assert "fp32_matmul='tf32'" in str(e.value)


def test_unknown_mode_is_refused_in_a_context_too():
    with pytest.raises(PowerFusionError, match="fp32_matmul"):
        with options.context(fp32_matmul="FP32-F"):
            pass


def test_cpu_target_ignores_the_option_with_one_note(monkeypatch):
    from powerfusion import InferenceSession, session
    monkeypatch.setattr(session, "_FP32_MATMUL_NOTED", [])
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 32), np.float32), rng.standard_normal((32, 8), np.float32)
    model = matmul_model(a.shape, b.shape, (16, 8))
    [exact] = InferenceSession(model, target="cpu").run(None, {"a": a, "b": b})
    with pytest.warns(session.Fp32MatmulIgnoredNote, match="CUDA target only"):
        sess = InferenceSession(model, target="cpu", options={"fp32_matmul": "fp32-f"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", session.Fp32MatmulIgnoredNote)   # said once only
        InferenceSession(model, target="cpu", options={"fp32_matmul": "auto"})
    [y] = sess.run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(y, exact)


def test_router_is_made_for_ape_modes_only():
    from powerfusion.backends.cuda import ape_route
    assert ape_route.router("fp32") is None
    for mode in APE_MODES:
        assert ape_route.router(mode).mode == mode
    with pytest.raises(PowerFusionError, match="fp32-b"):
        ape_route.ApeRouter("int16")


def test_a_compiled_folder_refuses_ape_modes():
    from types import SimpleNamespace
    from powerfusion.backends.cuda.artefact_runner import make_artefact_executor
    opts = options.current().replace(fp32_matmul="auto")
    with pytest.raises(PowerFusionError, match="fp32_matmul='auto'.*compiled folder 'out'"):
        make_artefact_executor(SimpleNamespace(folder="out"), opts)


def test_cli_flag_parses_into_session_options():
    from powerfusion.cli import build_parser
    from powerfusion.cli.common import flag_options
    parser = build_parser()
    for mode in FP32_MATMUL_MODES:
        args = parser.parse_args(["run", "m.onnx", "--target", "cuda", "--fp32-matmul", mode])
        assert flag_options(args) == {"fp32_matmul": mode}
    assert flag_options(parser.parse_args(["run", "m.onnx"])) == {}
    args = parser.parse_args(["bench", "m.onnx", "--target", "cuda", "--fp32-matmul", "fp32-b"])
    assert flag_options(args) == {"fp32_matmul": "fp32-b"}


def test_cli_flag_refuses_unknown_modes(capsys):
    from powerfusion.cli import main
    with pytest.raises(SystemExit) as e:
        main(["run", "m.onnx", "--fp32-matmul", "tf32"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--fp32-matmul" in err and "tf32" in err and "fp32-b" in err


def test_cli_run_on_cpu_accepts_the_flag(capsys, tmp_path, monkeypatch):
    from powerfusion import session
    from powerfusion.cli import main
    monkeypatch.setattr(session, "_FP32_MATMUL_NOTED", [])
    path = tmp_path / "mm.onnx"
    onnx.save(matmul_model((4, 8), (8, 3), (4, 3)), str(path))
    with pytest.warns(session.Fp32MatmulIgnoredNote):
        assert main(["-q", "run", str(path), "--target", "cpu", "--fp32-matmul", "auto"]) == 0
    assert "on cpu: 1 output(s)" in capsys.readouterr().out


# ---- GPU: routing and numerics --------------------------------------------------------

def _error(y, y64, scale) -> float:
    return float(np.max(np.abs(y.astype(np.float64) - y64) / np.maximum(scale, 1e-300)))


def _session(model, mode, cuda_graph=False):
    from powerfusion import InferenceSession
    return InferenceSession(model, target="cuda", options={"fp32_matmul": mode, "cuda_graph": cuda_graph})


def _check_routes(sess, mode, count: int, kind: str | None = None):
    routes = sess._executor.library_routes
    if mode == "fp32":
        assert routes == {}
        return
    assert len(routes) == count, routes
    for name, how in routes.items():
        assert how.startswith(f"ape {mode}"), (name, how)
        if kind:
            assert kind in how, (name, how)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("mode", FP32_MATMUL_MODES)
def test_matmul_batched_and_not(mode, cuda_graph):
    rng = np.random.default_rng(1)
    cases = [((96, 256), (256, 80), (96, 80), "1 GEMM(s)"),              # one GEMM
             ((2, 48, 256), (256, 80), (2, 48, 80), "1 GEMM(s) 96x80x256"),   # batch folded into M
             ((3, 40, 128), (3, 128, 72), (3, 40, 72), "3 GEMM(s)")]       # one GEMM per slice
    for a_shape, b_shape, y_shape, kind in cases:
        sess = _session(matmul_model(a_shape, b_shape, y_shape), mode, cuda_graph)
        for _ in range(2):   # a second run replays (graph) / reuses the plan, on new data
            a = rng.standard_normal(a_shape).astype(np.float32)
            b = rng.standard_normal(b_shape).astype(np.float32)
            [y] = sess.run(None, {"a": a, "b": b})
            y64 = np.matmul(a.astype(np.float64), b.astype(np.float64))
            scale = np.matmul(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
            assert _error(y, y64, scale) <= TOLERANCE[mode], (a_shape, mode)
        _check_routes(sess, mode, 1, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("mode", FP32_MATMUL_MODES)
def test_gemm_with_transposed_constant_weight(mode, cuda_graph):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((72, 384)).astype(np.float32)   # (N, K): transB = 1
    bias = rng.standard_normal(72).astype(np.float32)
    sess = _session(gemm_model(w, bias, 64), mode, cuda_graph)
    for _ in range(2):
        x = rng.standard_normal((64, 384)).astype(np.float32)
        [y] = sess.run(None, {"x": x})
        y64 = x.astype(np.float64) @ w.T.astype(np.float64) + bias
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.T.astype(np.float64)) + np.abs(bias)
        assert _error(y, y64, scale) <= TOLERANCE[mode]
    _check_routes(sess, mode, 1)


def _conv64(x, w, bias):
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))   # n c h w 3 3
    return np.einsum("nchwij,mcij->nmhw", win, w.astype(np.float64)) + bias.reshape(1, -1, 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FP32_MATMUL_MODES)
@pytest.mark.parametrize("batch", [1, 2])
def test_conv_through_its_gemm(mode, batch):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 64, 3, 3)).astype(np.float32)   # K = 64 * 9 = 576
    bias = rng.standard_normal(48).astype(np.float32)
    x = rng.standard_normal((batch, 64, 12, 12)).astype(np.float32)
    sess = _session(conv_model(x.shape, w, bias), mode)
    [y] = sess.run(None, {"x": x})
    scale = _conv64(np.abs(x), np.abs(w), np.abs(bias))
    assert _error(y, _conv64(x, w, bias), scale) <= TOLERANCE[mode]
    _check_routes(sess, mode, 1, f"{batch} GEMM(s) 48x144x576")


@pytest.mark.gpu
def test_auto_plans_again_when_the_data_leaves_the_planned_range():
    """First run in FP32-F's range: planned FP32-F; then values near 2^20, where FP32-F's split
    overflows: the session plans again (FP32-B) instead of returning Inf."""
    rng = np.random.default_rng(4)
    # M, N and K all >= 256 (engine_choice.cublas_pays), else auto runs SGEMM
    sess = _session(matmul_model((1024, 256), (256, 2048), (1024, 2048)), "auto")
    # magnitudes in [0.5, 2), random signs: every block inside FP32-F's range [2^-14, 2^15)
    a = (rng.uniform(0.5, 2.0, (1024, 256)) * rng.choice([-1, 1], (1024, 256))).astype(np.float32)
    b = (rng.uniform(0.5, 2.0, (256, 2048)) * rng.choice([-1, 1], (256, 2048))).astype(np.float32)
    sess.run(None, {"a": a, "b": b})
    [route] = sess._executor.library_routes.values()
    assert route.startswith("ape auto (plan fp32-f)"), route
    big = a * np.float32(2 ** 20)
    [y] = sess.run(None, {"a": big, "b": b})
    y64 = big.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(big.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.isfinite(y).all()
    assert _error(y, y64, scale) <= TOLERANCE["auto"]
    [route] = sess._executor.library_routes.values()
    assert "fp32-f" not in route, route


@pytest.mark.gpu
def test_fp16_matmul_stays_on_cublas_with_a_reason():
    a = np.ones((16, 32), np.float16)
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"])],
                   [helper.make_tensor_value_info("a", TensorProto.FLOAT16, [16, 32]),
                    helper.make_tensor_value_info("b", TensorProto.FLOAT16, [32, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [16, 8])])
    sess = _session(model, "fp32-f")
    [y] = sess.run(None, {"a": a, "b": np.ones((32, 8), np.float16)})
    np.testing.assert_array_equal(y, np.full((16, 8), 32, np.float16))
    [route] = sess._executor.library_routes.values()
    assert route.startswith("cublas: float16"), route
