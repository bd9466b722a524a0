"""NaN through max/min on the C-style GPU dialects: ONNX Max/Min/Relu/Clip (and numpy) give NaN
where an operand is NaN, C's fmaxf/fminf return the other operand (Relu(NaN) was 0 on CUDA).
The emitted CUDA/HIP source must use the dialect's NaN-propagating helpers everywhere
(elementwise and reduction combines) and compile with nvcc; on a GPU the results must equal
numpy's exactly (NaN at the same places, the other values bit-equal: max/min only select)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from powerfusion.backends.cstyle.renderer import nan_propagating

NAN_DROPPING = re.compile(r"(?<![\w])(fmaxf|fminf|fmax|fmin)\(")
SHAPE = [4, 96]


def _model(nodes, outputs, inits=()):
    g = h.make_graph(nodes, "nan_ops", [h.make_tensor_value_info("x", T.FLOAT, SHAPE),
                                        h.make_tensor_value_info("y", T.FLOAT, SHAPE)],
                     [h.make_tensor_value_info(o, T.FLOAT, s) for o, s in outputs], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _cases():
    lo, hi = nh.from_array(np.float32(-0.5), "lo"), nh.from_array(np.float32(0.5), "hi")
    return {
        "relu": (_model([h.make_node("Relu", ["x"], ["r"])], [("r", SHAPE)]),
                 lambda x, y: [np.maximum(x, 0)]),
        "max_min": (_model([h.make_node("Max", ["x", "y"], ["a"]), h.make_node("Min", ["x", "y"], ["b"])],
                           [("a", SHAPE), ("b", SHAPE)]),
                    lambda x, y: [np.maximum(x, y), np.minimum(x, y)]),
        "clip": (_model([h.make_node("Clip", ["x", "lo", "hi"], ["c"])], [("c", SHAPE)], [lo, hi]),
                 lambda x, y: [np.minimum(np.maximum(x, np.float32(-0.5)), np.float32(0.5))]),
        "reduce_max_min": (_model([h.make_node("ReduceMax", ["x"], ["m"], axes=[1], keepdims=0),
                                   h.make_node("ReduceMin", ["y"], ["n"], axes=[1], keepdims=0)],
                                  [("m", SHAPE[:1]), ("n", SHAPE[:1])]),
                           lambda x, y: [x.max(axis=1), y.min(axis=1)]),
        "fused": (_model([h.make_node("Relu", ["x"], ["r"]), h.make_node("Max", ["r", "y"], ["a"]),
                          h.make_node("ReduceMax", ["a"], ["m"], axes=[1], keepdims=0)], [("m", SHAPE[:1])]),
                  lambda x, y: [np.maximum(np.maximum(x, 0), y).max(axis=1)]),
    }


def _feeds():
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)
    x[0, ::7] = np.nan                 # NaN in the first operand
    y[1, ::5] = np.nan                 # ... in the second
    x[2, 3] = y[2, 3] = np.nan         # both
    x[3, :] = np.nan                   # a whole row (reductions)
    return {"x": x, "y": y}


def _without_helpers(source: str) -> str:
    """The source less the helpers' own definitions (they call fmaxf on non-NaN operands)."""
    return re.sub(r"#ifndef PF_NAN_OPS.*?#endif", "", source, flags=re.S)


def test_nan_propagating_spelling_is_idempotent():
    text = "fminf(fmaxf(x, 0.0f), 6.0f) + fmax(a, b) + my_fmaxf(c, d)"
    once = nan_propagating(text)
    assert once == "pf_fminf(pf_fmaxf(x, 0.0f), 6.0f) + pf_fmax(a, b) + my_fmaxf(c, d)"
    assert nan_propagating(once) == once


@pytest.mark.parametrize("case", sorted(_cases()))
def test_emitted_cuda_and_hip_propagate_nan(case):
    from powerfusion.compiler import compile_model
    model, _ = _cases()[case]
    plan = compile_model(model, "cuda")
    sources = [k.source for s in plan.kernel_steps for k in s.kernels]
    assert sources
    for src in sources:
        assert not NAN_DROPPING.search(_without_helpers(src)), src
    if case != "relu":   # Relu is x < 0 ? 0 : x (NaN and -0.0 pass through, as in onnxruntime)
        assert any("pf_fmaxf(" in s or "pf_fminf(" in s for s in sources)



@pytest.mark.parametrize("fn,params", [("max", {}), ("min", {}), ("relu", {}), ("clip", {"lo": -1.0, "hi": 1.0}),
                                       ("hard_sigmoid", {"alpha": 0.2, "beta": 0.5})])
def test_every_gpu_dialect_spells_max_min_with_the_helpers(fn, params):
    """HIP renders with the CUDA skeleton (which defines the helpers) and the shared scalar()."""
    from powerfusion.backends.cuda.renderer import CUDARenderer
    from powerfusion.backends.hip.renderer import HIPRenderer
    for r in (CUDARenderer(), HIPRenderer()):
        text = r.scalar(fn, params, ["a", "b"][:2 if fn in ("max", "min") else 1], "float32")
        assert ("pf_fm" in text or fn == "relu") and not NAN_DROPPING.search(text), text
        assert "PF_NAN_OPS" in r.env.get_template(r.skeleton).render(
            **{k: "" for k in ("graph_name", "name", "header", "index_type", "kernel_prefix", "launch_bounds",
                               "lanes", "units_per_group", "units")}, params=[], declarations=[], body=[],
            shared_bytes=0, faults=[])


@pytest.mark.usefixtures("nvcc")
@pytest.mark.parametrize("case", sorted(_cases()))
def test_emitted_cuda_with_nan_helpers_compiles(case):
    from powerfusion.backends.cuda.runtime import compile_check_nvcc
    from powerfusion.compiler import compile_model
    model, _ = _cases()[case]
    for step in compile_model(model, "cuda").kernel_steps:
        for k in step.kernels:
            compile_check_nvcc(k.source, "sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(_cases()))
def test_nan_on_cuda_matches_numpy(case):
    import powerfusion
    model, reference = _cases()[case]
    feeds = _feeds()
    got = powerfusion.InferenceSession(model.SerializeToString(), target="cuda").run(None, feeds)
    for g, w in zip(got, reference(feeds["x"], feeds["y"])):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(g[~np.isnan(w)], w[~np.isnan(w)])
