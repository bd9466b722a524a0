"""AMP and INT8 models on the CUDA target, against onnxruntime (CPU) on the same ONNX models.
Tolerances as in test_amp.py / test_qdq.py (fp16 2e-2, bf16 5e-2 relative; QDQ one output step)."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.precision import convert_precision
from powerfusion.session import InferenceSession

from .helpers import digits, digits_data, ort_run, rel_error
from .test_qdq import _ort_quantize, _output_step

pytestmark = pytest.mark.gpu     # skipped without a GPU (tests/conftest.py)


@pytest.mark.parametrize("name", ["digits_cnn", "digits_transformer"])
@pytest.mark.parametrize("precision,tol", [("fp16", 2e-2), ("bf16", 5e-2)])
def test_amp_on_cuda(name, precision, tol):
    x = digits_data()["x_test"][:64]
    ref = ort_run(convert_precision(digits(name), "fp16"), {"image": x})[0] if precision == "fp16" \
        else ort_run(digits(name), {"image": x})[0]
    sess = InferenceSession(digits(name), target="cuda", shapes={"image": x.shape}, options={"precision": precision})
    assert rel_error(sess.run(None, {"image": x})[0], ref) < tol


def test_static_qdq_on_cuda():
    q = _ort_quantize(digits("digits_cnn"), True, "QDQ", True)
    x = digits_data()["x_test"][:64]
    ours = InferenceSession(q, target="cuda", shapes={"image": x.shape}).run(None, {"image": x})[0]
    ref = ort_run(q, {"image": x}, optimize=False)[0]
    assert np.abs(ours - ref).max() <= _output_step(q) * 1.001
