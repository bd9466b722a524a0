"""The cpu backend: generated C (OpenMP) executed and compared with the interpreter.

Every template candidate of every basic op kind (the GIR test graphs of tests/gir), random
lowered subgraphs, and every memory-bound subgraph of every committed small model run as
compiled C. Tolerances: exact for integer and bool results; floats (libm's expf/tanhf/erff
differ from numpy's by an ulp, and sums are taken in another order) fp32 rtol 1e-5 / atol
1e-6, fp16 1e-3, bf16 8e-3 of the interpreter's value (as in tests/gir/test_fastexec.py),
and on whole models 1e-5 of the tensor's largest magnitude. Shared objects are cached under the cache directory, so
a second run of this file compiles nothing.
"""
from __future__ import annotations

import re
import warnings
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from powerfusion.backends.cpu import toolchain
from powerfusion.backends.cpu.runtime import NativeGraph, build_module
from powerfusion.backends.cpu.session import CPU_SESSION_TARGET
from powerfusion.gir.fastexec import FastProgram
from powerfusion.gir.interpreter import run_gir
from powerfusion.templates.merge import lower_subgraph
from powerfusion.rewrite import optimise
from powerfusion.templates import candidates
from powerfusion.templates.common import buffer_names
from tests.gir.test_fastexec import TEMPLATE_CASES, TOL
from tests.session_cases import small_model_names, small_model_session
from tests.templates.strategies import basic_cases


def run_native(graphs: list) -> list[NativeGraph]:
    """Render and compile many graphs in one parallel batch."""
    modules = [build_module(g) for g in graphs]
    return [NativeGraph(m, lib) for m, lib in zip(modules, toolchain.shared_objects([m.source for m in modules]))]


def assert_matches(got: dict, want: dict, label: str) -> None:
    for name, w in want.items():
        x = got[name].reshape(-1)
        w = np.asarray(w).reshape(-1)
        assert x.dtype == w.dtype and x.shape == w.shape, f"{label} {name}"
        if w.dtype.kind != "f" and w.dtype.name != "bfloat16":
            np.testing.assert_array_equal(x, w, err_msg=f"{label} {name}")
        else:
            rtol, atol = TOL[w.dtype.name]
            np.testing.assert_allclose(x.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol,
                                       err_msg=f"{label} {name}")


def check_graphs(graphs: list, feeds: list, labels: list) -> None:
    for g, f, native, label in zip(graphs, feeds, run_native(graphs), labels):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = run_gir(g, f)
        got = native.run(f, {b: (g.buffer(b).size,) for b in g.outputs})
        assert_matches(got, want, label)


@pytest.mark.parametrize("kind", list(TEMPLATE_CASES), ids=lambda k: k.__name__)
def test_every_template_candidate_runs_as_c(kind):
    graphs, feeds, labels = [], [], []
    for case in TEMPLATE_CASES[kind]:
        node = case.graph.nodes[-1]
        names = buffer_names(list(case.graph.tensors))
        for c in candidates(node, case.graph.tensors, "cpu", names):
            graphs.append(c.build())
            values = {**case.graph.constants, **case.feeds}   # the weights too, not poison
            feeds.append({names[t]: v for t, v in values.items() if names[t] in graphs[-1].inputs})
            labels.append(c.label)
    assert graphs
    check_graphs(graphs, feeds, labels)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(basic_cases(max_ops=4, max_rank=3, max_dim=12, dtypes=("float32", "float16", "bfloat16")))
def test_lowered_and_rewritten_subgraphs_run_as_c(case):
    g = lower_subgraph(case.subgraph, case.graph, None, CPU_SESSION_TARGET)
    check_graphs([g, optimise(g)[0]], [case.feeds] * 2, ["lowered", "rewritten"])


@pytest.mark.parametrize("name", small_model_names())
def test_committed_model_subgraphs_run_as_c(name):
    """Every subgraph's generated C against the fast GIR executor (the cpu-reference target,
    itself checked against the interpreter in tests/gir) on the session's own inputs."""
    sess, feeds = small_model_session(name)
    assert set(sess.subgraph_paths.values()) == {"c"}, sess.fallbacks
    env = sess.run_all_tensors(feeds)
    for k in sess.cpu_plan.kernels.values():
        ins = {b: env[t] for b, t in k.inputs}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = FastProgram(k.gir).run(ins)
        for b, t in k.outputs:
            w = want[b].reshape(-1).astype(np.float64)
            x = env[t].reshape(-1).astype(np.float64)
            scale = max(float(np.max(np.abs(w), initial=0.0)), 1.0)
            assert np.array_equal(np.isnan(x), np.isnan(w)), f"{name}.{k.subgraph.name}.{t}: NaN positions"
            err = float(np.nanmax(np.abs(x - w), initial=0.0)) / scale
            assert err < 1e-5, f"{name}.{k.subgraph.name}.{t}: error {err:.2e} of {scale:.2e}"


def test_shared_objects_are_cached_by_source(tmp_path):
    src = "int pf_cache_probe(void) { return 7; }\n"
    first = toolchain.shared_object(src, tmp_path)
    with mock.patch.object(toolchain, "_compile", side_effect=AssertionError("compiled again")):
        assert toolchain.shared_object(src, tmp_path) == first
        first.unlink()   # the loadable copy is rebuilt from the kernel cache, not recompiled
        assert toolchain.shared_object(src, tmp_path) == first and first.is_file()
    other = toolchain.shared_object(src + "\n", tmp_path)
    assert other != first


@pytest.mark.parametrize("cc,fragment", [("/nonexistent/cc", "no C compiler found"),
                                         ("false", "cannot build a shared object")])
def test_missing_or_broken_compiler_says_what_to_do(monkeypatch, cc, fragment):
    monkeypatch.setenv("CC", cc)
    toolchain.find_toolchain.cache_clear()
    try:
        with pytest.raises(toolchain.CompilerError) as info:
            toolchain.find_toolchain()
    finally:
        toolchain.find_toolchain.cache_clear()
    msg = str(info.value)
    assert fragment in msg and "apt-get install gcc" in msg and "target='cpu-reference'" in msg


def test_generated_c_keeps_floored_division_semantics():
    """GIR's floordiv/mod round toward minus infinity on negative offsets (C truncates)."""
    from powerfusion.gir.expr import U, I, J
    from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Move, Parallel
    n = 12
    src = MemorySlice("x", Level.GLOBAL, (U - 6) % n, 1, 1, "float32")
    reg = MemorySlice("r", Level.REGISTER, I * 1 + J, 1, 1, "float32")
    dst = MemorySlice("y", Level.GLOBAL, U, 1, 1, "float32")
    g = GIRGraph("floor", Parallel(n, 1, 1), (Buffer("x", Level.GLOBAL, n, "float32"),
                 Buffer("r", Level.REGISTER, 1, "float32"), Buffer("y", Level.GLOBAL, n, "float32")),
                 (GOp(Move(), (src,), (reg,), uid=0), GOp(Move(), (reg,), (dst,), uid=1)), ("x",), ("y",))
    x = np.arange(n, dtype=np.float32)
    check_graphs([g], [{"x": x}], ["floor"])


def test_integer_division_warns_that_it_runs_on_the_gir_executor():
    """The warning the test configuration filters (pyproject.toml) is still raised."""
    import warnings
    from onnx import TensorProto as T, helper as h
    import powerfusion
    from powerfusion.backends.cpu.session import NativeFallbackWarning
    g = h.make_graph([h.make_node("Div", ["a", "b"], ["c"])], "idiv",
                     [h.make_tensor_value_info(n, T.INT32, [8]) for n in "ab"], [h.make_tensor_value_info("c", T.INT32, [8])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        powerfusion.InferenceSession(model.SerializeToString(), target="cpu")
    assert any(issubclass(w.category, NativeFallbackWarning) and "GIR executor" in str(w.message) for w in caught)


def test_compile_cli_writes_c_files_that_compile(tmp_path):
    """`powerfusion compile --target cpu` writes one .c file per kernel and the plan; each file
    builds on its own with the system compiler."""
    import json
    import subprocess
    from powerfusion import cli
    from tests.session_cases import SMALL
    out = tmp_path / "out"
    assert cli.main(["-q", "compile", str(SMALL / "resnet_small.onnx"), "--target", "cpu", "-o", str(out),
                     "--no-cache"]) == 0
    sources = sorted(out.glob("*.c"))
    plan = json.loads((out / "plan.json").read_text())
    assert sources and plan["target"] == "cpu"
    tc = toolchain.find_toolchain()
    for src in sources:
        res = subprocess.run([tc.compiler, *[f for f in tc.flags if f != "-shared"], "-c", str(src), "-o",
                              str(tmp_path / "k.o")], capture_output=True, text=True)
        assert res.returncode == 0, f"{src.name}: {res.stderr[-1500:]}"


@pytest.mark.parametrize("x_shape,w_shape,strides,pads,dilations,group", [
    ((1, 16, 7, 7), (8, 16, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),        # 1x1: a plain GEMM
    ((2, 8, 9, 9), (8, 1, 3, 3), (2, 1), (1, 1, 1, 1), (1, 1), 8),          # depthwise, strided, padded
    ((1, 6, 10, 8), (9, 2, 3, 2), (1, 2), (2, 0, 1, 1), (2, 1), 3),         # grouped, dilated, uneven pads
    ((2, 4, 11), (6, 4, 3), (2,), (1, 2), (1,), 1),                          # 1-D
    ((1, 64, 14, 14), (128, 64, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),    # large enough to split the GEMM
])
def test_conv_runner_matches_reference(x_shape, w_shape, strides, pads, dilations, group):
    """Planned-buffer Conv (fp32, numpy BLAS, summation order of the GEMM) against the reference
    im2col of session.conv_nd: rtol 1e-5 / atol 1e-5; twice, so reused buffers are checked."""
    from powerfusion.backends.cpu.library import conv_runner
    from powerfusion.basic import Conv
    from powerfusion.session import conv_nd
    rng = np.random.default_rng(3)
    nsp = len(x_shape) - 2
    op = Conv(strides, pads[:nsp], pads[nsp:], dilations, group)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    want0 = conv_nd(rng.standard_normal(x_shape).astype(np.float32), w, b, op)
    runner = conv_runner(op, x_shape, w, want0.shape, np.float32)
    for seed in (4, 5):
        x = np.random.default_rng(seed).standard_normal(x_shape).astype(np.float32)
        np.testing.assert_allclose(runner(x, w, b), conv_nd(x, w, b, op), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a_shape,b_shape,trans_a,trans_b", [
    ((3, 40), (40, 24), False, False), ((2, 5, 64), (64, 300), False, False),
    ((200, 64), (300, 64), False, True), ((4, 64, 8), (4, 64, 130), True, False)])
def test_matmul_runner_matches_numpy(a_shape, b_shape, trans_a, trans_b):
    from powerfusion.backends.cpu.library import MatMulRunner
    from powerfusion.basic import MatMul
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
    want = np.matmul(np.swapaxes(a, -1, -2) if trans_a else a, np.swapaxes(b, -1, -2) if trans_b else b)
    got = MatMulRunner(MatMul(trans_a, trans_b), np.empty(want.shape, np.float32))(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_float4_casts_run_as_c_and_match_the_interpreter():
    """Cast to and from FLOAT4E2M1 (stored one code a byte, as ml_dtypes' float4_e2m1fn) in
    generated C, bit for bit the cpu-reference target's (ml_dtypes') codes: ties to the even
    code, saturation at 6, signed zeros, NaN of either sign, infinities, subnormal inputs."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper
    from powerfusion import InferenceSession
    f4 = TensorProto.FLOAT4E2M1
    nodes = [helper.make_node("Cast", ["x"], ["q"], to=f4), helper.make_node("Cast", ["q"], ["d"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["d", "z"], ["y"]), helper.make_node("Mul", ["x", "z"], ["xz"]),
             helper.make_node("Cast", ["xz"], ["q2"], to=f4)]
    n = 64
    graph = helper.make_graph(nodes, "f4", [helper.make_tensor_value_info(v, TensorProto.FLOAT, [n]) for v in "xz"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n]),
                               helper.make_tensor_value_info("q2", f4, [n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 11
    edges = [0.0, -0.0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0, 1e30, np.inf, -np.inf,
             np.nan, -np.nan, 1e-45, -1e-45, -0.25, -0.74, -2.6, -5.0, -100.0]
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(edges, np.float32), rng.uniform(-8, 8, n - len(edges)).astype(np.float32)])
    x[16], x[17] = np.float32(np.nan), -np.float32(np.nan)   # both signs of NaN, whatever the literal gives
    feeds = {"x": x, "z": np.ones(n, np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback to the GIR executor
        sess = InferenceSession(model)
    assert set(sess.subgraph_paths.values()) == {"c"}, sess.fallbacks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = sess.run(None, feeds)
        want = InferenceSession(model, target="cpu-reference").run(None, feeds)
    codes = (x * feeds["z"]).astype(ml_dtypes.float4_e2m1fn)
    assert got[1].dtype == codes.dtype
    np.testing.assert_array_equal(got[1].view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(got[1].view(np.uint8), want[1].view(np.uint8))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[0], x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32) + 1)



def test_streamed_sums_of_several_slots_run_as_simd_scalars():
    """A streamed float sum over rows of a few slots keeps one scalar accumulator a slot under
    the SIMD reduction (an array of them was one serial add chain a slot); the template
    candidates that render so run as C against the interpreter (the sum is reordered: fp32
    tolerance)."""
    from powerfusion.backends.cpu.renderer import render_module
    pattern = re.compile(r"#pragma omp simd reduction\(\+:\w+_s0, \w+_s1\b")
    graphs, feeds, labels = [], [], []
    for cases in TEMPLATE_CASES.values():
        for case in cases:
            names = buffer_names(list(case.graph.tensors))
            for c in candidates(case.graph.nodes[-1], case.graph.tensors, "cpu", names):
                g = c.build()
                if pattern.search(render_module(g)[0]):
                    values = {**case.graph.constants, **case.feeds}
                    graphs.append(g)
                    feeds.append({names[t]: v for t, v in values.items() if names[t] in g.inputs})
                    labels.append(c.label)
    assert graphs, "no template candidate streams a sum of several slots"
    check_graphs(graphs, feeds, labels)
