"""Cross-layer equalisation keeps the function and balances channel ranges."""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from powerfusion.precision.equalize import equalize, find_pairs

from tests.precision.helpers import digits, digits_data, ort_run, rel_error


def _channel_ranges(model, name):
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}[name]
    return np.abs(w).reshape(w.shape[0], -1).max(1)


def test_equalize_keeps_outputs_and_balances_ranges():
    m = digits("digits_cnn_imbalanced")
    pairs = find_pairs(m)
    assert [(p.first.op_type, p.second.op_type) for p in pairs] == [("Conv", "Conv"), ("Gemm", "Gemm")]
    eq, n = equalize(m)
    x = digits_data()["x_test"][:32]
    assert rel_error(ort_run(eq, {"image": x})[0], ort_run(m, {"image": x})[0]) < 1e-4
    w1 = pairs[0].first.input[1]
    before, after = _channel_ranges(m, w1), _channel_ranges(eq, w1)
    assert before.max() / before.min() > 1000 and after.max() / after.min() < 30
