"""Property-based differential tests: random small ONNX graphs (tests/reliability/fuzz_graphs.py)
must agree with onnxruntime -- same shapes, NaN where it has NaN, equal infinities, finite
values within float32 tolerances -- or both must refuse the input. Three profiles:

* the CPU session (its GIR on the fast executor, or the basic-op fallback);
* the plan compiled for CUDA, its rewritten GIR run on the reference interpreter;
* the same plan's CUDA sources compiled by nvcc for sm_90 (skipped without nvcc), and in the
  slow run the HIP plan's sources by hipcc for gfx90a (skipped without hipcc).

The default run checks a few hundred graphs from fixed seeds; the slow run
(`PF_FUZZ_SLOW=1 pytest -m slow tests/reliability`) checks `PF_FUZZ_EXAMPLES` (5000) per
profile with fresh seeds (the compile profiles in batches: batch_compile.py).
"""
from __future__ import annotations

import os
import shutil
import sys
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
# Tolerance of a finite output element w (ours g): |g - w| <= ATOL + RTOL |w| + SUM_RTOL m.
# RTOL/ATOL cover float32 elementwise functions computed differently (exp/tanh/sigmoid from
# numpy vs onnxruntime's own). A sum's rounding error depends on its order (fused,
# reassociated reductions of up to 64 terms): it is bounded by (n - 1) 2^-24 sum |terms|, which
# can be far above |w| when terms cancel (1e30 - 1e30 + 3.5), so m is the output evaluated on
# the terms' magnitudes (`magnitude_model`: Abs before every ReduceSum/ReduceMean, Add and
# Sub of absolute values); SUM_RTOL = 64 x 2^-24 ~ 3.8e-6, rounded up to 1e-5 for the steps
# after the sum. Where m overflows float32 the order decides between inf, NaN and a finite
# value, so such elements are not compared.
RTOL, ATOL, SUM_RTOL = 1e-4, 1e-5, 1e-5
SUM_LIKE = ("ReduceSum", "ReduceMean")


def _reference(model, feeds):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _mean_of_nothing(model) -> bool:
    """Whether a ReduceMean reduces an empty set into a non-empty output (ONNX: undefined)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output)}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    for n in model.graph.node:
        if n.op_type == "ReduceMean" and n.input[0] in shapes and n.output[0] in shapes:
            size_in, size_out = np.prod(shapes[n.input[0]], dtype=np.int64), np.prod(shapes[n.output[0]], dtype=np.int64)
            if size_in == 0 and size_out > 0:
                return True
    return False


def magnitude_model(model):
    """`model` evaluated on the magnitudes of summed terms: every ReduceSum/ReduceMean reads
    Abs of its data, every Add/Sub adds the Abs of its operands (other ops unchanged). Its
    outputs bound the size of the terms each output's sums added, for the order tolerance."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = []
    for k, node in enumerate(m.graph.node):
        absolute = [0] if node.op_type in SUM_LIKE else [0, 1] if node.op_type in ("Add", "Sub") else []
        for i in absolute:
            name = f"magnitude_{k}_{i}"
            nodes.append(onnx.helper.make_node("Abs", [node.input[i]], [name], name=name))
            node.input[i] = name
        if node.op_type == "Sub":
            node.op_type = "Add"
        nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def _order_tolerance(model, feeds) -> list | None:
    """SUM_RTOL x each output's magnitude (NaN where it overflows), or None without sums."""
    if not any(n.op_type in SUM_LIKE for n in model.graph.node):
        return None
    with np.errstate(all="ignore"):
        mags = [np.abs(np.asarray(m, np.float64)) for m in _reference(magnitude_model(model), feeds)]
        return [np.where(np.isinf(m) | (m > np.finfo(np.float32).max), np.nan, SUM_RTOL * np.nan_to_num(m))
                for m in mags]


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
    # ONNX leaves max/min of NaN open: numpy (ours) propagates it, onnxruntime's reductions drop
    # it; and the mean of an empty set (ours NaN, as numpy; onnxruntime 0)
    nan_open = any(n.op_type in NAN_OPEN for n in model.graph.node) or _mean_of_nothing(model)
    order = _order_tolerance(model, feeds) or [None] * len(want)
    for out, g, w, tol in zip(model.graph.output, got, want, order):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{out.name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        tol = np.zeros(w.shape) if tol is None else np.broadcast_to(tol, w.shape)
        keep = ~np.isnan(tol)               # a sum whose terms' magnitude overflows: order-open
        if nan_open:
            keep &= ~np.isnan(g) & ~np.isnan(w)
        g, w, tol = g[keep], w[keep], tol[keep]
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{out.name}: NaN positions")
        inf = np.isinf(w)
        np.testing.assert_array_equal(g[inf], w[inf], err_msg=f"{out.name}: infinities")
        fin = ~np.isnan(w) & ~inf
        err = np.abs(g[fin].astype(np.float64) - w[fin])
        bound = ATOL + RTOL * np.abs(w[fin].astype(np.float64)) + tol[fin]
        assert np.all(err <= bound), (f"{out.name}: |ours - onnxruntime| {err.max():.3g} above the bound "
                                      f"(at {np.argmax(err - bound)}: {err[np.argmax(err - bound)]:.3g} > "
                                      f"{bound[np.argmax(err - bound)]:.3g}); ours {g[fin]}, onnxruntime {w[fin]}")


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


def emitted_kernels(model, target: str) -> list:
    """The kernels `compile_model` emits for `target` (none where it refuses with a clear error:
    the other profiles check that it should)."""
    from powerfusion.compiler import compile_model
    from tests.reliability.batch_compile import Kernel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = compile_model(model, target)
        except PowerFusionError:
            return []
    text = onnx.printer.to_text(model.graph)
    return [Kernel(k.name, k.source, text) for step in plan.kernel_steps for k in step.kernels]


def compile_fuzzed(target: str, compiler) -> None:
    """SLOW_EXAMPLES random graphs compiled for `target`, every kernel through `compiler` in
    batches (batch_compile.py: one compiler run per ~200 distinct kernels, two at a time). The
    compiler runs after hypothesis has drawn every example, so a failure is reported with the
    model that emitted the kernel rather than shrunk."""
    import json
    import time
    from tests.reliability.batch_compile import compile_all
    kernels, examples = [], []

    @settings(max_examples=SLOW_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(graphs(max_steps=8))
    def collect(case):
        found = emitted_kernels(case[0], target)
        examples.append(bool(found))
        kernels.extend(found)

    start = time.perf_counter()
    collect()
    generated = time.perf_counter() - start
    failures, counts = compile_all(kernels, compiler)
    stats = {"examples": len(examples), "with_kernels": sum(examples), **counts,
             "generate_s": round(generated, 1), "compile_s": round(time.perf_counter() - start - generated, 1),
             "failures": len(failures)}
    if os.environ.get("PF_FUZZ_STATS"):
        with open(os.environ["PF_FUZZ_STATS"], "w") as f:
            json.dump(stats, f)
    assert len(examples) >= SLOW_EXAMPLES, stats
    assert not failures, "\n\n".join(f"{compiler.name} {compiler.arch} rejected a kernel of\n{f.kernels[0].origin}\n"
                                      f"{f.message}" for f in failures[:3])


@NVCC
@LONG[0]
@LONG[1]
def test_random_graphs_compile_with_nvcc_long():
    from tests.reliability.batch_compile import NVCC_SM90
    compile_fuzzed("cuda", NVCC_SM90)


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="needs hipcc")
@LONG[0]
@LONG[1]
def test_random_graphs_compile_with_hipcc_long():
    from tests.reliability.batch_compile import HIPCC_GFX90A
    compile_fuzzed("hip", HIPCC_GFX90A)


@NVCC
def test_batched_compile_names_the_failing_kernel():
    """A batch holding one kernel nvcc rejects reports that kernel alone (with nvcc's message),
    and a batch that only fails together (two definitions of one helper) is reported, not
    passed: the batching can neither hide a finding nor invent a pass."""
    from tests.reliability.batch_compile import NVCC_SM90, Kernel, compile_all
    good = [Kernel(f"k{n}", f'extern "C" __global__ void k{n}(float* p) {{ p[0] = {n}.0f; }}', f"good {n}")
            for n in range(5)]
    bad = Kernel("kb", 'extern "C" __global__ void kb(float* p) { p[0] = undeclared_name; }', "bad")
    failures, counts = compile_all(good[:3] + [bad] + good[3:] + good[:2], NVCC_SM90, per_unit=4)
    assert counts == {"kernels": 8, "distinct": 6, "units": 2}
    assert [f.kernels for f in failures] == [(bad,)] and "undeclared_name" in failures[0].message
    helper = "__device__ float pf_twice(float x) { return 2 * x; }\n"
    clash = [Kernel(f"c{n}", helper + f'extern "C" __global__ void c{n}(float* p) {{ p[0] = pf_twice({n}); }}',
                    f"clash {n}") for n in range(2)]
    failures, _ = compile_all(clash, NVCC_SM90)
    assert len(failures) == 1 and len(failures[0].kernels) == 2
    assert failures[0].message.startswith("fails only when compiled together")


def test_order_tolerance_follows_the_summed_magnitudes(monkeypatch):
    """A sum whose terms cancel may differ by its order (about 2^-24 x sum |terms|), not more."""
    from onnx import TensorProto as T, helper as h
    monkeypatch.setattr(sys.modules[__name__], "note", lambda text: None)   # hypothesis notes need a given
    g = h.make_graph([h.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "sum",
                     [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("y", T.FLOAT, [2])],
                     [onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    feeds = {"x": np.array([[1e30, 3.5, -1e30], [1.0, 2.0, 3.0]], np.float32)}
    magnitudes = _reference(magnitude_model(model), feeds)[0]
    np.testing.assert_allclose(magnitudes, [2e30, 6.0], rtol=1e-6)
    want = _reference(model, feeds)[0]
    other_order = want.copy()
    other_order[0] = 3.5 if want[0] != 3.5 else 0.0   # (1e30 - 1e30) + 3.5 vs (1e30 + 3.5) - 1e30
    check_against_onnxruntime(model, feeds, run=lambda m, f: [other_order])
    wrong = want.copy()
    wrong[1] += 1e-3                                  # 6 +- 1e-3: beyond 1e-5 + 1e-4 x 6 + 1e-5 x 6
    with pytest.raises(AssertionError, match="above the bound"):
        check_against_onnxruntime(model, feeds, run=lambda m, f: [wrong])
