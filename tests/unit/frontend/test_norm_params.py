"""loader._match_norm_params: a float16 model whose float32 residual reaches LayerNormalization
with float16 Scale / B (as torch 2.11 exports BERT-base in half precision) is invalid ONNX that
strict inference and onnxruntime refuse; PowerFusion converts the constant parameters to X's type
(exact for float16 -> float32), warns, and computes what the model means: checked against
onnxruntime on the same model with float32 parameters (fp16 output tolerance 2e-3)."""
from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T, helper as h, numpy_helper as nh

import powerfusion


def _model(param_dtype):
    rng = np.random.default_rng(0)
    nodes = [h.make_node("Cast", ["x"], ["xf"], to=T.FLOAT), h.make_node("Add", ["xf", "b32"], ["s"]),
             h.make_node("LayerNormalization", ["s", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
             h.make_node("Cast", ["ln"], ["y"], to=T.FLOAT16)]
    inits = [nh.from_array(rng.standard_normal(16).astype(np.float32), "b32"),
             nh.from_array((rng.random(16) + 0.5).astype(np.float16).astype(param_dtype), "g"),
             nh.from_array(rng.standard_normal(16).astype(np.float16).astype(param_dtype), "b")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT16, [2, 16])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [2, 16])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_mixed_type_layernorm_params_are_matched_to_their_input():
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float16)
    want = ort.InferenceSession(_model(np.float32).SerializeToString()).run(None, {"x": x})[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = powerfusion.InferenceSession(_model(np.float16).SerializeToString(), target="cpu").run(None, {"x": x})[0]
    assert any("normalization parameter(s) converted" in str(w.message) for w in caught)
    assert np.abs(got.astype(np.float64) - want.astype(np.float64)).max() <= 2e-3 * np.abs(want).max()


def test_consistent_models_are_left_alone():
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no conversion warning for a valid model
        powerfusion.InferenceSession(_model(np.float32).SerializeToString(), target="cpu").run(None, {"x": x})
