"""The committed small models: well-formed, static, inside the frontend's op set, runnable in
onnxruntime, described truthfully by models/small/manifest.json. No torch needed."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's `models` package, also under plain `pytest`
from models import SMALL_DIR as SMALL, small_manifest, small_model_path  # noqa: E402
from models.onnx_tools import (FRONTEND_OPS, TensorSpec, dynamic_tensors,  # noqa: E402
                               infer_static_shapes, op_histogram, run_onnxruntime, sample_inputs)

MANIFEST = small_manifest()
NAMES = ("bert_small", "gpt2_prefill_small", "gpt2_decode_small", "vit_small", "shufflenet_small",
         "efficientnet_small", "resnet_small", "sardrn_small", "rednet_small")
SIZE_BUDGET = 6 * 2**20  # bytes, all small models together


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(small_model_path(name))


def _specs(name: str, which: str) -> list[TensorSpec]:
    return [TensorSpec.from_json(d) for d in MANIFEST["models"][name][which]]


def _run(name: str, feeds: dict) -> dict:
    return run_onnxruntime(_load(name), feeds)


def test_manifest_lists_exactly_the_committed_files():
    assert sorted(MANIFEST["models"]) == sorted(NAMES)
    on_disk = sorted(p.stem for p in SMALL.glob("*.onnx"))
    assert on_disk == sorted(NAMES)


def test_unknown_model_name_lists_the_available_ones():
    with pytest.raises(KeyError, match="gpt2_decode_small"):
        small_model_path("gpt3_small")


def test_small_models_fit_the_size_budget():
    total = sum((SMALL / f"{n}.onnx").stat().st_size for n in NAMES)
    assert total == MANIFEST["total_bytes"]
    assert total < SIZE_BUDGET, f"{total} bytes"


@pytest.mark.parametrize("name", NAMES)
def test_model_is_valid_static_and_supported(name):
    entry = MANIFEST["models"][name]
    model = _load(name)
    onnx.checker.check_model(model, full_check=True)
    assert (SMALL / entry["file"]).stat().st_size == entry["size_bytes"]
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == entry["opset"] and opset in (17, 18)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert set(op_histogram(model)) <= FRONTEND_OPS, set(op_histogram(model)) - FRONTEND_OPS
    assert op_histogram(model) == entry["op_histogram"]
    assert dynamic_tensors(infer_static_shapes(model)) == []


@pytest.mark.parametrize("name", NAMES)
def test_manifest_io_matches_graph(name):
    model = _load(name)
    for which, graph_io in (("inputs", model.graph.input), ("outputs", model.graph.output)):
        specs = _specs(name, which)
        assert [s.name for s in specs] == [v.name for v in graph_io]
        for s, v in zip(specs, graph_io):
            dims = tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
            assert dims == s.shape, (s.name, dims, s.shape)
            assert onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) == np.dtype(s.dtype)
    for s in _specs(name, "inputs"):  # integer inputs carry the range of values they accept
        assert (s.low is not None) == s.dtype.startswith("int"), s


@pytest.mark.parametrize("name", NAMES)
def test_runs_in_onnxruntime_with_finite_outputs(name):
    got = _run(name, sample_inputs(_specs(name, "inputs"), seed=7))
    for s in _specs(name, "outputs"):
        assert got[s.name].shape == s.shape
        assert np.all(np.isfinite(got[s.name])), s.name
        assert np.std(got[s.name]) > 0, f"{s.name} is constant"


def test_gpt2_decode_appends_the_new_key_and_value_to_the_cache():
    feeds = sample_inputs(_specs("gpt2_decode_small", "inputs"), seed=1)
    got = _run("gpt2_decode_small", feeds)
    layers = sum(1 for s in _specs("gpt2_decode_small", "inputs") if s.name.startswith("past_key_"))
    assert layers >= 1
    for i in range(layers):
        for kind in ("key", "value"):
            past, present = feeds[f"past_{kind}_{i}"], got[f"present_{kind}_{i}"]
            assert present.shape[2] == past.shape[2] + 1
            np.testing.assert_array_equal(present[:, :, :-1], past)


def test_gpt2_decode_output_depends_on_the_cache():
    feeds = sample_inputs(_specs("gpt2_decode_small", "inputs"), seed=2)
    base = _run("gpt2_decode_small", feeds)["logits"]
    feeds["past_value_0"] = feeds["past_value_0"] * 2.0
    assert not np.allclose(_run("gpt2_decode_small", feeds)["logits"], base, atol=1e-5)


def test_gpt2_prefill_is_causal():
    feeds = sample_inputs(_specs("gpt2_prefill_small", "inputs"), seed=3)
    base = _run("gpt2_prefill_small", feeds)["logits"]
    vocab = _specs("gpt2_prefill_small", "inputs")[0].high + 1
    feeds["input_ids"][:, -1] = (feeds["input_ids"][:, -1] + 1) % vocab
    changed = _run("gpt2_prefill_small", feeds)["logits"]
    np.testing.assert_allclose(changed[:, :-1], base[:, :-1], rtol=1e-5, atol=1e-5)  # fp32 reruns
    assert not np.allclose(changed[:, -1], base[:, -1], atol=1e-4)


def test_bert_attention_mask_hides_masked_tokens():
    feeds = sample_inputs(_specs("bert_small", "inputs"), seed=4)
    feeds["attention_mask"][:] = 1
    feeds["attention_mask"][:, 5] = 0
    base = _run("bert_small", feeds)["last_hidden_state"]
    vocab = _specs("bert_small", "inputs")[0].high + 1
    feeds["input_ids"][:, 5] = (feeds["input_ids"][:, 5] + 1) % vocab
    changed = _run("bert_small", feeds)["last_hidden_state"]
    others = [j for j in range(base.shape[1]) if j != 5]
    np.testing.assert_allclose(changed[:, others], base[:, others], rtol=1e-5, atol=1e-5)
    assert not np.allclose(changed[:, 5], base[:, 5], atol=1e-4)


def test_sardrn_preserves_the_image_shape():
    (inp,), (out,) = _specs("sardrn_small", "inputs"), _specs("sardrn_small", "outputs")
    assert inp.shape == out.shape and inp.shape[1] == 1
