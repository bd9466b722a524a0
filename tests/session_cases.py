"""The committed small models as CPU sessions, built once per test process and shared by
tests/test_session.py and tests/gir/test_fastexec.py (lowering every subgraph is the
expensive part of creating a session)."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "small"


def small_models() -> dict:
    return json.loads((SMALL / "manifest.json").read_text())["models"]


def small_model_names() -> list[str]:
    return sorted(small_models())


@functools.cache
def small_model_session(name: str, target: str = "cpu"):
    """(InferenceSession on `target` (cpu: generated C; cpu-reference: the fast GIR executor),
    feeds drawn from the manifest's input specs)."""
    import onnx
    sys.path.insert(0, str(ROOT))
    from models.onnx_tools import TensorSpec, sample_inputs
    from powerfusion.session import InferenceSession
    entry = small_models()[name]
    feeds = sample_inputs([TensorSpec.from_json(d) for d in entry["inputs"]], seed=5)
    return InferenceSession(onnx.load(SMALL / entry["file"]), target=target), feeds
