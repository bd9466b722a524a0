"""Every bundled small model goes through the frontend, and the basic-op graph's numpy
executor agrees with onnxruntime (float32: max |diff| / max |ort| < 1e-4)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from models.onnx_tools import TensorSpec, run_onnxruntime, sample_inputs  # noqa: E402
from powerfusion.frontend import import_model, run_basic_graph  # noqa: E402

SMALL = ROOT / "models" / "small"
MODELS = json.loads((SMALL / "manifest.json").read_text())["models"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_frontend_matches_onnxruntime(name):
    entry = MODELS[name]
    model = onnx.load(SMALL / entry["file"])
    feeds = sample_inputs([TensorSpec.from_json(d) for d in entry["inputs"]], seed=5)
    got = run_basic_graph(import_model(model), feeds)
    want = run_onnxruntime(model, feeds)
    for out, ref in want.items():
        assert got[out].shape == ref.shape, out
        err = float(np.max(np.abs(got[out].astype(np.float64) - ref))) / float(np.max(np.abs(ref)))
        assert err < 1e-4, f"{name}.{out}: relative error {err:.2e}"
