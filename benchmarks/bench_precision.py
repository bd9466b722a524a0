"""Precision on the GPU: our fp32 against AMP fp16 / bf16 and INT8 (static, dynamic), with
torch.compile of the same module in fp32, fp16 (`.half()`) and bf16.

    PYTHONPATH=$PWD python3 benchmarks/bench_precision.py [--out DIR] [--only NAME]

Models: the committed small CNNs whose torch recipes need only torch (bench_models.CNNS).
Per model and implementation: device time of a captured run (ours: one CUDA-graph replay of the
session's captured pieces between events, median of 30; torch: harness.time_torch), and
`max_rel_error_vs_fp32`: max |out - our fp32 out| / max |our fp32 out|.
INT8 static: calibration data are 16 seeded random input sets (models.export.sample_inputs),
minmax, per-channel weights; dynamic: onnxruntime's quantize_dynamic. Our INT8 path lowers the
quantised GEMMs / convs to float32 library calls (precision/qdq.py): these rows measure that
path as it is, not integer tensor cores.
Writes <out>/precision.{json,md} (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_models import CNNS  # noqa: E402

OURS = ("fp32", "fp16", "bf16", "int8-static", "int8-dynamic")


def _device_time(sess) -> float:
    from bench_models import graph_replay_times
    return statistics.median(graph_replay_times(sess))


def _model_for(kind: str, model, recipe):
    from powerfusion.precision.calibration import check_calibration
    from powerfusion.precision.ptq import QuantizeOptions, quantize_model
    from models.export import sample_inputs
    if kind == "int8-static":
        sets = [sample_inputs(recipe.inputs, seed) for seed in range(16)]
        cal = check_calibration({k: np.stack([s[k] for s in sets]) for k in sets[0]}, model)
        return quantize_model(model, cal, QuantizeOptions("minmax", per_channel=True))
    if kind == "int8-dynamic":
        return quantize_model(model, None, QuantizeOptions(dynamic=True))
    return model


def bench(name: str) -> list[dict]:
    import onnx
    import torch
    from harness import time_torch
    from models.export import sample_inputs
    from powerfusion import InferenceSession
    recipe = getattr(importlib.import_module(f"models.{CNNS[name]}"), f"{CNNS[name]}_recipe")(small=True)
    feeds = sample_inputs(recipe.inputs, 0)
    model = onnx.load(ROOT / "models" / "small" / f"{name}.onnx")
    rows, ref = [], None
    for kind in OURS:
        try:
            m = _model_for(kind, model, recipe)
            precision = kind if kind in ("fp16", "bf16") else "fp32"
            sess = InferenceSession(m, target="cuda", options={"cuda_graph": True, "precision": precision})
            out = np.asarray(sess.run(None, feeds)[0], np.float64)
            ref = out if ref is None else ref
            rows.append({"case": name, "impl": f"powerfusion {kind}", "device_time_s": _device_time(sess),
                         "max_rel_error_vs_fp32": float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))})
        except Exception:
            rows.append({"case": name, "impl": f"powerfusion {kind}", "error": traceback.format_exc(limit=3)[-800:]})
    module = recipe.module.eval().cuda()
    for label, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        mod = module.to(dtype)
        args = tuple(torch.from_numpy(feeds[s.name]).cuda().to(dtype) if feeds[s.name].dtype.kind == "f"
                     else torch.from_numpy(feeds[s.name]).cuda() for s in recipe.inputs)
        with torch.no_grad():
            compiled = torch.compile(mod, dynamic=False)
            out = compiled(*args)
            out = (out[0] if isinstance(out, (tuple, list)) else out).float().cpu().numpy().astype(np.float64)
            t = time_torch(compiled, [args], latency_calls=10)
        err = None if ref is None else float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        rows.append({"case": name, "impl": f"torch.compile {label}", "device_time_s": t.device_time_s,
                     "max_rel_error_vs_fp32": err})
    return rows


def summary(rows: list[dict]) -> dict:
    """Geomean speed-ups over the models where both rows exist."""
    def geo(a: str, b: str):
        r = []
        for case in {x["case"] for x in rows}:
            t = {x["impl"]: x.get("device_time_s") for x in rows if x["case"] == case}
            if t.get(a) and t.get(b):
                r.append(t[b] / t[a])
        return float(np.exp(np.mean(np.log(r)))) if r else None
    return {"amp_fp16_over_our_fp32": geo("powerfusion fp16", "powerfusion fp32"),
            "amp_bf16_over_our_fp32": geo("powerfusion bf16", "powerfusion fp32"),
            "amp_fp16_over_torch_compile_fp16": geo("powerfusion fp16", "torch.compile fp16"),
            "int8_static_over_our_fp16": geo("powerfusion int8-static", "powerfusion fp16")}


def main(argv=None) -> int:
    from harness import run_metadata, write_results
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    rows = []
    for name in CNNS:
        if args.only in name:
            rows += bench(name)
            for r in rows[-8:]:
                print(f"{r['case']:20s} {r['impl']:26s} " + (f"{r['device_time_s'] * 1e6:9.1f} us  "
                      f"err {r['max_rel_error_vs_fp32']}" if "device_time_s" in r else r["error"][-200:]), flush=True)
    meta = run_metadata(suite="precision", geomean=summary(rows))
    print(meta["geomean"])
    for r in rows:
        r.setdefault("dtype", r["impl"].split()[-1])
        r.setdefault("shape", "")
        r.setdefault("latency_s", float("nan"))
        r.setdefault("bytes", 0)
        r.setdefault("bw_fraction", float("nan"))
        r.setdefault("kernels", 0)
    write_results("precision", rows, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
