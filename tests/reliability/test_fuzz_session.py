"""Property-based differential tests: random small ONNX graphs (tests/reliability/fuzz_graphs.py)
must agree with onnxruntime -- same shapes, NaN where it has NaN, equal infinities, finite
values within float32 tolerances -- or both must refuse the input. Three profiles:

* the CPU session (its GIR on the fast executor, or the basic-op fallback);
* the plan compiled for CUDA, its rewritten GIR run on the reference interpreter;
* the same plan's CUDA sources compiled by nvcc (skipped without nvcc).

The default run checks a few hundred graphs from fixed seeds; the slow run
(`PF_FUZZ_SLOW=1 pytest -m slow tests/reliability`) checks `PF_FUZZ_EXAMPLES` (5000) per
profile with fresh seeds (nvcc: a tenth of that).
"""
from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, note, seed, settings

import powerfusion
from powerfusion.errors import PowerFusionError
from tests.reliability.fuzz_graphs import graphs

DEFAULT_EXAMPLES = 300
NAN_OPEN = ("Max", "Min", "ReduceMax", "ReduceMin")
# float32 through a different evaluation order (fused, reassociated reductions of up to 64
# terms, exp/tanh/sigmoid from numpy vs onnxruntime's own): 1e-4 relative, 1e-5 absolute
RTOL, ATOL = 1e-4, 1e-5


def _reference(model, feeds):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _session(model, feeds):
    return powerfusion.InferenceSession(model).run(None, feeds)


def _interpreted(model, feeds):
    """Outputs of the CUDA plan on the interpreter; None where the compiler declines, by its
    documented rule, a kernel that reads a zero-size tensor (the CPU session profile runs those)."""
    from powerfusion.compiler import compile_model
    from powerfusion.errors import UnsupportedOpError
    from tests.reliability.plan_interpreter import run_plan
    try:
        plan = compile_model(model, "cuda")
    except UnsupportedOpError as e:
        if "kernels over zero-size tensors are not generated" in str(e):
            return None
        raise
    env = run_plan(plan, feeds)
    return [env[o.name] for o in model.graph.output]


def check_against_onnxruntime(model, feeds, run=_session) -> None:
    note(onnx.printer.to_text(model.graph))
    note(repr(feeds))
    try:
        want = _reference(model, feeds)
    except Exception:   # onnxruntime refuses (e.g. an index out of range): so must we
        with pytest.raises(PowerFusionError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(model, feeds)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # basic-op fallbacks are allowed; wrong numbers are not
        got = run(model, feeds)
    if got is None:
        return
    # ONNX leaves max/min of NaN open: numpy (ours) propagates it, onnxruntime's reductions drop it
    nan_open = any(n.op_type in NAN_OPEN for n in model.graph.node)
    for out, g, w in zip(model.graph.output, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{out.name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        if nan_open:
            g, w = g[~np.isnan(g) & ~np.isnan(w)], w[~np.isnan(g) & ~np.isnan(w)]
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{out.name}: NaN positions")
        inf = np.isinf(w)
        np.testing.assert_array_equal(g[inf], w[inf], err_msg=f"{out.name}: infinities")
        fin = ~np.isnan(w) & ~inf
        np.testing.assert_allclose(g[fin], w[fin], rtol=RTOL, atol=ATOL, err_msg=out.name)


@seed(20261124)
@settings(max_examples=DEFAULT_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(graphs())
def test_random_graphs_match_onnxruntime(case):
    check_against_onnxruntime(*case)


@seed(20261125)
@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(graphs())
def test_random_graphs_compiled_for_cuda_match_on_the_interpreter(case):
    check_against_onnxruntime(*case, run=_interpreted)


def check_nvcc_compiles(model, feeds) -> None:
    from powerfusion.backends.cuda.runtime import compile_check_nvcc
    from powerfusion.compiler import compile_model
    note(onnx.printer.to_text(model.graph))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = compile_model(model, "cuda")
        except PowerFusionError:
            return   # refused with a clear error (the other profiles check that it should be)
    for step in plan.kernel_steps:
        for k in step.kernels:
            compile_check_nvcc(k.source, "sm_90")


NVCC = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@NVCC
@seed(20261126)
@settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(graphs())
def test_random_graphs_compile_with_nvcc(case):
    check_nvcc_compiles(*case)


SLOW_EXAMPLES = int(os.environ.get("PF_FUZZ_EXAMPLES", "5000"))
LONG = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("PF_FUZZ_SLOW") != "1",
                                             reason="set PF_FUZZ_SLOW=1 for the long fuzz run")]


@pytest.mark.parametrize("profile", ["session", "interpreter"])
@LONG[0]
@LONG[1]
@settings(max_examples=SLOW_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=graphs(max_steps=8))
def test_random_graphs_match_onnxruntime_long(profile, case):
    check_against_onnxruntime(*case, run=_session if profile == "session" else _interpreted)


@NVCC
@LONG[0]
@LONG[1]
@settings(max_examples=max(SLOW_EXAMPLES // 10, 1), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(graphs(max_steps=8))
def test_random_graphs_compile_with_nvcc_long(case):
    check_nvcc_compiles(*case)
