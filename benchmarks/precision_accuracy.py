"""Held-out accuracy of the digits models (models/digits) in every precision PowerFusion offers.

    python3 benchmarks/precision_accuracy.py      # CPU; about a minute

fp32, AMP fp16 and AMP bf16 run through `InferenceSession(..., options={"precision": ...})`;
INT8 models come from `powerfusion.precision.quantize_model` (static: 200 training images as
calibration data; dynamic: none) and run through our session too, with onnxruntime's accuracy
on the same QDQ model alongside. Dynamic models run one image at a time (activation scales per
image, as a served model would see them). Writes benchmarks/results/precision-accuracy.{json,md}.
"""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = ("digits_cnn", "digits_transformer", "digits_cnn_imbalanced")
INT8 = [("int8 minmax", dict(method="minmax")), ("int8 percentile", dict(method="percentile")),
        ("int8 entropy", dict(method="entropy")), ("int8 minmax per-channel", dict(method="minmax", per_channel=True)),
        ("int8 minmax symmetric", dict(method="minmax", symmetric=True)),
        ("int8 minmax + CLE", dict(method="minmax", equalize=True)),
        ("int8 entropy + CLE", dict(method="entropy", equalize=True)),
        ("int8 dynamic", dict(dynamic=True))]


def accuracy(logits, y) -> float:
    return float((np.asarray(logits).argmax(1) == y).mean())


def ours(model, x, precision="fp32", per_sample=False):
    from powerfusion.session import InferenceSession
    if per_sample:
        s = InferenceSession(model, shapes={"image": (1,) + x.shape[1:]}, options={"precision": precision})
        return np.concatenate([s.run(None, {"image": x[i:i + 1]})[0] for i in range(len(x))])
    return InferenceSession(model, shapes={"image": x.shape}, options={"precision": precision}).run(None, {"image": x})[0]


def ort(model, x, per_sample=False):
    import onnxruntime as rt
    so = rt.SessionOptions()
    so.log_severity_level = 3
    s = rt.InferenceSession(model.SerializeToString(), so)
    if per_sample:
        return np.concatenate([s.run(None, {"image": x[i:i + 1]})[0] for i in range(len(x))])
    return s.run(None, {"image": x})[0]


def measure(name: str, data) -> list[dict]:
    from powerfusion.precision.calibration import check_calibration
    from powerfusion.precision.ptq import QuantizeOptions, quantize_model
    m = onnx.load(ROOT / "models" / "digits" / f"{name}.onnx")
    x, y = data["x_test"], data["y_test"]
    ref = ours(m, x)
    rows = [{"model": name, "precision": "fp32", "ours": accuracy(ref, y), "onnxruntime": accuracy(ort(m, x), y)}]
    for p in ("fp16", "bf16"):
        out = ours(m, x, p)
        rows.append({"model": name, "precision": f"AMP {p}", "ours": accuracy(out, y), "onnxruntime": None,
                     "max_rel_error_vs_fp32": float(np.abs(out - ref).max() / np.abs(ref).max())})
    cal = check_calibration({"image": data["x_calib"]}, m)
    for label, kw in INT8:
        q = quantize_model(m, cal, QuantizeOptions(**kw))
        dyn = kw.get("dynamic", False)
        out = ours(q, x, per_sample=dyn)
        rows.append({"model": name, "precision": label, "ours": accuracy(out, y),
                     "onnxruntime": accuracy(ort(q, x, per_sample=dyn), y),
                     "max_rel_error_vs_fp32": float(np.abs(out - ref).max() / np.abs(ref).max())})
    for r in rows:
        r["loss_vs_fp32"] = rows[0]["ours"] - r["ours"]
        print(f"{name:24s} {r['precision']:26s} ours {r['ours']:.4f}  ort {r['onnxruntime']}", flush=True)
    return rows


def write(rows: list[dict], n_test: int) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"device": "CPU (PowerFusion CPU session: numpy library calls + GIR executor)",
            "date": dt.date.today().isoformat(), "commit": commit, "held_out_images": n_test,
            "data": "sklearn.datasets.load_digits, 20 % stratified held-out split (seed 0)"}
    out = ROOT / "benchmarks" / "results"
    (out / "precision-accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Digits accuracy by precision ({meta['date']}, commit {commit}, {meta['device']})", "",
             f"Held-out images: {n_test} ({meta['data']}). Loss is in accuracy points against our fp32.", "",
             "| model | precision | ours | onnxruntime | loss vs fp32 | max rel. output error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ortv = "-" if r["onnxruntime"] is None else f"{r['onnxruntime']:.4f}"
        err = r.get("max_rel_error_vs_fp32")
        lines.append(f"| {r['model']} | {r['precision']} | {r['ours']:.4f} | {ortv} | {100 * r['loss_vs_fp32']:+.2f} % | "
                     f"{'-' if err is None else f'{err:.3g}'} |")
    lines += ["", "Notes: AMP bf16 of the CNNs (opset 17) keeps the convolutions in fp32 (ONNX has no bf16 Conv "
              "before opset 22), so only their Gemms run in bf16. digits_cnn_imbalanced is digits_cnn with "
              "its first conv's channels scaled by 2**-6..2**6 and the second conv's inputs by the inverses "
              "(the same function): the case where plain PTQ loses accuracy and equalisation (CLE) restores it. "
              "Dynamic INT8 runs one image at a time; the rest run all held-out images as one batch."]
    (out / "precision-accuracy.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    warnings.filterwarnings("ignore")
    import logging
    logging.disable(logging.WARNING)
    data = np.load(ROOT / "models" / "digits" / "digits_data.npz")
    rows = [r for name in MODELS for r in measure(name, data)]
    write(rows, len(data["y_test"]))


if __name__ == "__main__":
    main()
