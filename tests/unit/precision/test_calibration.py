"""Calibration data checks, quantize() end to end, and the CLI's errors for bad data."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.cli import main as cli_main
from powerfusion.precision.calibration import CalibrationDataError, check_calibration, load_calibration
from powerfusion.precision.ptq import QuantizeOptions, quantize_model

from tests.precision.helpers import DIGITS, digits, digits_data, ort_run

pytest.importorskip("onnxruntime.quantization")


@pytest.mark.parametrize("arrays,message", [
    ({"img": np.zeros((4, 1, 8, 8), np.float32)}, "unknown \\['img'\\], missing \\['image'\\]"),
    ({"image": np.zeros((4, 1, 8, 8), np.float64)}, "dtype float64; the model takes float32"),
    ({"image": np.zeros((4, 1, 4, 8), np.float32)}, "axis 2 differs"),
    ({"image": np.zeros((4, 8, 8), np.float32)}, "expected \\[samples, \\?, 1, 8, 8\\]"),
    ({"image": np.zeros((0, 1, 8, 8), np.float32)}, "no samples"),
    ({"image": np.full((2, 1, 8, 8), np.nan, np.float32)}, "NaN"),
])
def test_bad_calibration_data(arrays, message):
    with pytest.raises(CalibrationDataError, match=message):
        check_calibration(arrays, digits("digits_cnn"))


def test_stacked_samples_and_batched_rows_both_accepted():
    m = digits("digits_cnn")
    x = digits_data()["x_calib"][:5]
    assert check_calibration({"image": x}, m).sample(0)["image"].shape == (1, 1, 8, 8)
    assert check_calibration({"image": x[:, None]}, m).count == 5


def test_not_an_npz(tmp_path):
    p = tmp_path / "x.npz"
    p.write_text("not a zip")
    with pytest.raises(CalibrationDataError, match="not an .npz"):
        load_calibration(str(p), digits("digits_cnn"))


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_quantize_static_keeps_top1(method):
    m = digits("digits_cnn")
    d = digits_data()
    q = quantize_model(m, check_calibration({"image": d["x_calib"][:60]}, m), QuantizeOptions(method))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in q.graph.node}
    x = d["x_test"][:100]
    agree = np.mean(ort_run(q, {"image": x})[0].argmax(1) == ort_run(m, {"image": x})[0].argmax(1))
    assert agree >= 0.97


def test_cli_quantize_reports_bad_data(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, image=np.zeros((3, 1, 8, 8), np.float64))
    rc = cli_main(["quantize", f"{DIGITS}/digits_cnn.onnx", "--calibration", str(bad), "-o", str(tmp_path / "q.onnx")])
    assert rc == 2 and "dtype float64" in capsys.readouterr().err


def test_cli_quantize_and_convert_write_models_onnxruntime_runs(tmp_path, capsys):
    import onnx
    cal = tmp_path / "cal.npz"
    np.savez(cal, image=digits_data()["x_calib"][:20])
    q, h = tmp_path / "q.onnx", tmp_path / "h.onnx"
    assert cli_main(["quantize", f"{DIGITS}/digits_cnn.onnx", "--calibration", str(cal), "--per-channel",
                     "--symmetric", "-o", str(q)]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    assert cli_main(["convert", f"{DIGITS}/digits_cnn.onnx", "--precision", "fp16", "-o", str(h)]) == 0
    x = digits_data()["x_test"][:4]
    for path in (q, h):
        assert ort_run(onnx.load(path), {"image": x})[0].shape == (4, 10)
