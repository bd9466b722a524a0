"""float16 and bfloat16 through InferenceSession(target="cuda"): committed small models and
memory-bound subgraphs, converted from float32 (weights, inputs, outputs, Cast targets).

Reference: onnxruntime CPU on the float32 model whose weights and inputs are the low-precision
values (rounded, then widened back), as tests/unit/frontend/test_dtypes.py does; onnxruntime's CPU
provider lacks bfloat16 (and float16) kernels for several of these ops. So the reference is
exact arithmetic on the same numbers, and the difference measures our intermediate rounding.

Tolerances (stated per dtype):
  models      max |got - ref| / max |ref|     float16 2e-2, bfloat16 1.2e-1
              (several layers of activations stored in 16 bits between kernels)
  subgraphs   |got - ref| <= atol + rtol |ref| elementwise, float16 rtol = atol = 1e-2,
              bfloat16 rtol = atol = 4e-2 (a few units in the last place of each type)
  integer and bool outputs: exact.
Every planned buffer is poisoned with 0xFF bytes (NaN in float16 and bfloat16, -1 in
integers) before the run, and float outputs must be finite, so unwritten elements show.

Compiling these models takes CPU minutes and no GPU: benchmarks/precompile_conformance.py also
compiles them ("dtypes/<name>/<dtype>" in its folder, PF_CUDA_PLANS). When a plan from there
matches the session's graph (same compiler sources, same inputs and outputs), the session runs
it instead of searching again; everything else (import, partition, buffers, kernels) is the
session's own. Without the folder the session compiles.
"""
from __future__ import annotations

import functools
import json
import sys
from unittest import mock
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from models.onnx_tools import TensorSpec, run_onnxruntime, sample_inputs  # noqa: E402

SMALL = ROOT / "models" / "small"
MODELS = ("bert_small", "gpt2_decode_small", "resnet_small", "vit_small")
DTYPES = ("float16", "bfloat16")
MODEL_TOL = {"float16": 2e-2, "bfloat16": 1.2e-1}
SUBGRAPH_TOL = {"float16": 1e-2, "bfloat16": 4e-2}
ONNX_TYPE = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
# ops whose bfloat16 type constraint starts at opset 22 (earlier opsets reject bf16 models)
BF16_FROM_22 = {"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "InstanceNormalization"}


def np_low(dtype: str) -> np.dtype:
    from powerfusion.gir.interpreter import np_dtype
    return np_dtype(dtype)


# ---- float32 -> float16 / bfloat16 ----------------------------------------------------

def _low_tensor(t: onnx.TensorProto, dtype: str) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np_low(dtype)), t.name)


def to_low_precision(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """Every float32 tensor of `model` as `dtype`: initializers, graph inputs and outputs,
    value_info, Constant / ConstantOfShape values and Cast targets."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for k, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT:
            g.initializer[k].CopyFrom(_low_tensor(t, dtype))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = ONNX_TYPE[dtype]
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = ONNX_TYPE[dtype]
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(_low_tensor(a.t, dtype))
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
    if dtype == "bfloat16" and opset < 22 and BF16_FROM_22 & {n.op_type for n in g.node}:
        from onnx import version_converter
        m = version_converter.convert_version(m, 22)
    return m


def rounded_reference_model(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """The float32 model with its float weights rounded to `dtype` and widened back."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for k, t in enumerate(m.graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            a = numpy_helper.to_array(t).astype(np_low(dtype)).astype(np.float32)
            m.graph.initializer[k].CopyFrom(numpy_helper.from_array(a, t.name))
    return m


def low_feeds(feeds: dict, dtype: str) -> tuple[dict, dict]:
    """(feeds for the low-precision model, the same values in float32 for the reference)."""
    low = {k: v.astype(np_low(dtype)) if v.dtype == np.float32 else v for k, v in feeds.items()}
    wide = {k: v.astype(np.float32) if v.dtype == np_low(dtype) else v for k, v in low.items()}
    return low, wide


# ---- running --------------------------------------------------------------------------

def dtype_key(name: str, dtype: str) -> str:
    return f"dtypes/{name}/{dtype}"


@functools.cache
def plan_store():
    sys.path.insert(0, str(ROOT / "tests" / "conformance"))
    from test_cuda_conformance import PLANS_DIR, PlanStore
    return PlanStore(PLANS_DIR)


def _signature(tensors) -> list:
    return [(t.name, tuple(t.shape), np.dtype(t.dtype).name) for t in tensors]


def run_cuda_poisoned(model: onnx.ModelProto, feeds: dict, key: str) -> dict:
    from powerfusion import InferenceSession
    from powerfusion import session as session_module
    from powerfusion.pipeline.driver import compile, front
    plan = plan_store().load(key)

    def precompiled(model, target, options, observers=()):
        part = front(model, target, options, observers)
        graph = part.graph
        if plan is not None and target == plan.target and _signature(graph.inputs) == _signature(plan.graph.inputs) \
                and _signature(graph.outputs) == _signature(plan.graph.outputs):
            return plan
        return compile(part, target, options, observers)

    with mock.patch.object(session_module, "compile", precompiled):
        sess = InferenceSession(model, target="cuda")
    sess._executor.arena.fill(0xFF)  # every planned buffer: NaN in 16-bit floats, -1 in integers
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _norm_err(got, ref) -> float:
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    return float(np.max(np.abs(got - ref))) / max(float(np.max(np.abs(ref))), 1e-30)


def check_outputs(got: dict, want: dict, dtype: str, what: str, elementwise: bool) -> None:
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape, f"{what}.{name}: shape {out.shape}, expected {ref.shape}"
        if ref.dtype.kind in "iub":
            assert out.dtype == ref.dtype and np.array_equal(out, ref), f"{what}.{name}: integer output differs"
            continue
        assert out.dtype == np_low(dtype), f"{what}.{name}: dtype {out.dtype}, expected {dtype}"
        wide = out.astype(np.float32)
        assert np.isfinite(wide).all(), f"{what}.{name}: {int((~np.isfinite(wide)).sum())} unwritten or non-finite"
        if elementwise:
            tol = SUBGRAPH_TOL[dtype]
            np.testing.assert_allclose(wide, ref, rtol=tol, atol=tol, err_msg=f"{what}.{name} ({dtype})")
        else:
            err = _norm_err(wide, ref)
            assert err < MODEL_TOL[dtype], f"{what}.{name}: max error / max |ref| = {err:.2e} ({dtype})"


# ---- committed models ------------------------------------------------------------------

def model_case(name: str, dtype: str):
    """(low-precision model, its feeds, the float32 reference outputs)."""
    entry = json.loads((SMALL / "manifest.json").read_text())["models"][name]
    model = onnx.load(SMALL / entry["file"])
    feeds = sample_inputs([TensorSpec.from_json(d) for d in entry["inputs"]], seed=3)
    low, wide = low_feeds(feeds, dtype)
    return to_low_precision(model, dtype), low, run_onnxruntime(rounded_reference_model(model, dtype), wide)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_low_precision_model_matches_fp32_reference(name, dtype):
    model, feeds, want = model_case(name, dtype)
    check_outputs(run_cuda_poisoned(model, feeds, dtype_key(name, dtype)), want, dtype, name, elementwise=False)


# ---- memory-bound subgraphs ------------------------------------------------------------

def _graph(name, nodes, inputs, outputs, inits=(), opset=18) -> onnx.ModelProto:
    F = TensorProto.FLOAT
    vi = lambda n, s, t=F: helper.make_tensor_value_info(n, t, list(s))  # noqa: E731
    g = helper.make_graph(nodes, name, [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def subgraph_models() -> dict[str, tuple[onnx.ModelProto, dict]]:
    """float32 models of memory-bound subgraphs cut from transformers and CNNs, with feeds."""
    r = np.random.default_rng(7)
    f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    mk = helper.make_node
    B = TensorProto.BOOL
    out = {}
    out["layernorm"] = (_graph("layernorm", [mk("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1, epsilon=1e-5)],
                               [("x", (64, 768))], [("y", (64, 768))], [("w", f(768)), ("b", f(768))]),
                        {"x": f(64, 768)})
    out["add_layernorm"] = (_graph("add_layernorm", [
        mk("Add", ["x", "res"], ["s"]), mk("LayerNormalization", ["s", "w", "b"], ["y"], axis=-1, epsilon=1e-5)],
        [("x", (32, 1000)), ("res", (32, 1000))], [("y", (32, 1000)), ("s", (32, 1000))],
        [("w", f(1000)), ("b", f(1000))]), {"x": f(32, 1000), "res": f(32, 1000)})
    out["rmsnorm"] = (_graph("rmsnorm", [
        mk("Mul", ["x", "x"], ["sq"]), mk("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1),
        mk("Add", ["ms", "eps"], ["mse"]), mk("Sqrt", ["mse"], ["rms"]), mk("Div", ["x", "rms"], ["n"]),
        mk("Mul", ["n", "w"], ["y"])], [("x", (48, 1024))], [("y", (48, 1024))],
        [("ax", np.array([-1], np.int64)), ("eps", np.array(1e-6, np.float32)), ("w", f(1024))]), {"x": f(48, 1024)})
    out["scale_mask_softmax"] = (_graph("scale_mask_softmax", [
        mk("Mul", ["x", "scale"], ["xs"]), mk("Where", ["keep", "xs", "neg"], ["xm"]),
        mk("Softmax", ["xm"], ["y"], axis=-1)], [("x", (2, 4, 64, 64)), ("keep", (1, 1, 64, 64), B)],
        [("y", (2, 4, 64, 64))], [("scale", np.array(0.125, np.float32)), ("neg", np.array(-1e4, np.float32))]),
        {"x": f(2, 4, 64, 64) * 4, "keep": np.tril(np.ones((64, 64), bool))[None, None]})
    s2 = np.float32(np.sqrt(2.0))
    out["bias_gelu"] = (_graph("bias_gelu", [
        mk("Add", ["x", "b"], ["h"]), mk("Div", ["h", "s2"], ["hs"]), mk("Erf", ["hs"], ["e"]),
        mk("Add", ["e", "one"], ["e1"]), mk("Mul", ["h", "e1"], ["he"]), mk("Mul", ["he", "half"], ["y"])],
        [("x", (128, 1024))], [("y", (128, 1024))],
        [("b", f(1024)), ("s2", np.array(s2)), ("one", np.array(1, np.float32)), ("half", np.array(0.5, np.float32))]),
        {"x": f(128, 1024)})
    out["merge_heads"] = (_graph("merge_heads", [
        mk("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]), mk("Reshape", ["t", "shape"], ["y"])],
        [("x", (2, 8, 64, 64))], [("y", (2, 64, 512))], [("shape", np.array([2, 64, 512], np.int64))]),
        {"x": f(2, 8, 64, 64)})
    # integer, bool and mixed-precision values around the low-precision ones
    out["embed_mask_stats"] = (_graph("embed_mask_stats", [
        mk("Gather", ["table", "ids"], ["e"], axis=0), mk("Cast", ["e"], ["e32"], to=TensorProto.FLOAT),
        mk("ReduceSum", ["e32", "ax"], ["total"], keepdims=0), mk("Greater", ["e", "zero"], ["pos"]),
        mk("Cast", ["pos"], ["npos"], to=TensorProto.INT64), mk("ReduceSum", ["npos", "ax"], ["count"], keepdims=0)],
        [("ids", (4, 16), TensorProto.INT64)],
        [("e", (4, 16, 96)), ("total", (4, 16)), ("pos", (4, 16, 96), B), ("count", (4, 16), TensorProto.INT64)],
        [("table", f(500, 96)), ("ax", np.array([-1], np.int64)), ("zero", np.array(0, np.float32))]),
        {"ids": r.integers(0, 500, (4, 16)).astype(np.int64)})
    return out


def subgraph_case(name: str, dtype: str):
    model, feeds = subgraph_models()[name]
    low, wide = low_feeds(feeds, dtype)
    low_model = to_low_precision(model, dtype)
    if name == "embed_mask_stats":  # 'total' is summed in float32 on purpose: keep it float32
        _keep_float32(low_model, "e32", "total")
    want = run_onnxruntime(rounded_reference_model(model, dtype), wide)
    return low_model, low, want


def _keep_float32(model: onnx.ModelProto, *names: str) -> None:
    for node in model.graph.node:
        if node.op_type == "Cast" and node.output[0] in names:
            node.attribute[0].i = TensorProto.FLOAT
    for vi in model.graph.output:
        if vi.name in names:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT


def dtype_cases():
    """(key, low-precision model) of every model and subgraph case, for precompiling."""
    for dtype in DTYPES:
        for name in MODELS:
            yield dtype_key(name, dtype), lambda n=name, d=dtype: model_case(n, d)[0]
        for name in SUBGRAPHS:
            yield dtype_key(name, dtype), lambda n=name, d=dtype: subgraph_case(n, d)[0]


SUBGRAPHS = ("layernorm", "add_layernorm", "rmsnorm", "scale_mask_softmax", "bias_gelu", "merge_heads",
             "embed_mask_stats")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SUBGRAPHS)
def test_low_precision_subgraph_matches_fp32_reference(name, dtype):
    model, feeds, want = subgraph_case(name, dtype)
    got = run_cuda_poisoned(model, feeds, dtype_key(name, dtype))
    if name == "embed_mask_stats":  # the float32 sum of 96 low-precision values: float32 output
        total = want.pop("total")
        np.testing.assert_allclose(got["total"], total, rtol=1e-5, atol=1e-4)
    check_outputs(got, want, dtype, name, elementwise=True)


def test_conversion_keeps_the_model_valid():
    """Runs without a GPU: every converted model passes onnx's checker and imports."""
    from powerfusion.frontend import import_model
    for dtype in DTYPES:
        for name in SUBGRAPHS:
            model, _, _ = subgraph_case(name, dtype)
            onnx.checker.check_model(model, full_check=True)
            assert any(np.dtype(t.dtype) == np_low(dtype) for t in import_model(model).outputs)
