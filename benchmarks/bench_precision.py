"""Precision on the GPU: our fp32 against AMP fp16 / bf16 and INT8 (static, dynamic), with
torch.compile of the same module in fp32, fp16 (`.half()`) and bf16.

    PYTHONPATH=$PWD python3 benchmarks/bench_precision.py [--out DIR] [--only NAME]

Models: the committed small CNNs whose torch recipes need only torch (bench_models.CNNS), and
`bert_base_like`: BERT-base's layer (hidden 768, 12 heads, FFN 3072, sequence 128, batch 1)
with `--bert-layers` layers (default 4, so one device call holds its export, quantisation and
compiles; per-layer time is what the comparison needs), and `resnet50_like` (ResNet-50 with
`--resnet-blocks` bottlenecks per stage), both built in plain torch and exported on the spot.
Per model and implementation: device time of a captured run (ours: one CUDA-graph replay of the
session's captured pieces between events, median of 30; torch: harness.time_torch), and
`max_rel_error_vs_fp32`: max |out - our fp32 out| / max |our fp32 out| (`error_reference` names
the row compared with: the first of `--kinds`, fp32 unless a run leaves it out).
INT8 static: calibration data are 16 seeded random input sets (models.export.sample_inputs),
minmax, per-channel weights, Q/DQ on every op onnxruntime quantises ("int8-static") or only on
the inputs of GEMMs with constant weights ("int8-gemms", ptq.py's ops="weight-gemms"); a
"+fp16" suffix runs the float parts in AMP fp16; dynamic: onnxruntime's quantize_dynamic.
`--bert-shapes 1x128,8x128` adds cases "bert_base_like 8x128" (batch x sequence), run with
`--other-kinds`. Quantised MatMuls with
int8 weights run as int8 x int8 -> int32 cuBLAS GEMMs (IMMA; `int8_gemms` counts the steps per
route: imma-lt through cuBLASLt's heuristic, imma through cublasGemmEx), quantised 2-D convs as
im2col + the same int8 GEMM.
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


def bert_base_like(layers: int, batch: int = 1, seq: int = 128):
    """(recipe, ONNX model): BERT-base's encoder layer (post-LN, hidden 768, 12 heads, FFN 3072,
    GELU) `layers` times on float hidden states [batch, seq, 768], in plain torch (the GPU machine
    has no transformers), random weights, exported with the TorchScript exporter."""
    import io
    import onnx
    import torch
    from models.export import Recipe
    from models.onnx_tools import TensorSpec
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[_EncoderLayer() for _ in range(layers)]).eval()
    recipe = Recipe(name="bert_base_like", module=module, inputs=(TensorSpec("hidden", (batch, seq, 768), "float32"),),
                    outputs=("out",), description=f"BERT-base encoder layer x{layers}", exporter="legacy", opset=17)
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module, (torch.zeros(batch, seq, 768),), buf, input_names=["hidden"], output_names=["out"],
                          opset_version=17, dynamo=False)
    return recipe, onnx.load_from_string(buf.getvalue())


def resnet50_like(blocks: tuple[int, ...]):
    """(recipe, ONNX model): ResNet-50 (width 64, 224x224, 1000 classes) with `blocks`
    bottlenecks per stage ((3, 4, 6, 3) is ResNet-50 itself), exported here (models/resnet.py)."""
    from models import resnet
    from models.export import export
    full = resnet.FULL
    try:
        resnet.FULL = dict(full, blocks=tuple(blocks))
        recipe = resnet.resnet_recipe(small=False)
    finally:
        resnet.FULL = full
    return recipe, export(recipe).model


def _encoder_layer_class():
    import torch

    class EncoderLayer(torch.nn.Module):
        def __init__(self, d: int = 768, heads: int = 12, ffn: int = 3072):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.up, self.down = torch.nn.Linear(d, ffn), torch.nn.Linear(ffn, d)

        def forward(self, x):
            b, s, d = x.shape
            split = lambda t: t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
            x = self.ln1(x + self.o((att @ v).transpose(1, 2).reshape(b, s, d)))
            return self.ln2(x + self.down(torch.nn.functional.gelu(self.up(x))))
    return EncoderLayer


def _EncoderLayer():
    return _encoder_layer_class()()


def _int8_gemms(sess) -> str:
    routes = list(getattr(sess._executor, "int8_routes", {}).values())
    lt, imma = sum(r == "imma-lt" for r in routes), sum(r == "imma" for r in routes)
    rest = sorted(set(routes) - {"imma", "imma-lt"})
    return f"{lt} imma-lt, {imma} imma, {len(routes) - imma - lt} fallback" + (f" ({rest})" if rest else "")


def _model_for(kind: str, model, recipe):
    from powerfusion.precision.calibration import check_calibration
    from powerfusion.precision.ptq import QuantizeOptions, quantize_model
    from models.export import sample_inputs
    if kind == "int8-static":
        sets = [sample_inputs(recipe.inputs, seed) for seed in range(16)]
        cal = check_calibration({k: np.stack([s[k] for s in sets]) for k in sets[0]}, model)
        return quantize_model(model, cal, QuantizeOptions("minmax", per_channel=True))
    if kind == "int8-gemms":    # Q/DQ only around the GEMMs with constant weights (ptq.py)
        sets = [sample_inputs(recipe.inputs, seed) for seed in range(16)]
        cal = check_calibration({k: np.stack([s[k] for s in sets]) for k in sets[0]}, model)
        return quantize_model(model, cal, QuantizeOptions("minmax", per_channel=True, ops="weight-gemms"))
    if kind == "int8-dynamic":
        return quantize_model(model, None, QuantizeOptions(dynamic=True))
    return model


def bench(name: str, kinds=OURS, torch_kinds=("fp32", "fp16", "bf16"), bert_layers: int = 4,
          resnet_blocks=(3, 4, 6, 3), bert_shape=(1, 128)) -> list[dict]:
    import onnx
    import torch
    from harness import time_torch
    from models.export import sample_inputs
    from powerfusion import InferenceSession
    case = name
    if name == "bert_base_like":
        recipe, model = bert_base_like(bert_layers, *bert_shape)
        case = name if tuple(bert_shape) == (1, 128) else f"{name} {bert_shape[0]}x{bert_shape[1]}"
    elif name == "resnet50_like":
        recipe, model = resnet50_like(resnet_blocks)
    else:
        recipe = getattr(importlib.import_module(f"models.{CNNS[name]}"), f"{CNNS[name]}_recipe")(small=True)
        model = onnx.load(ROOT / "models" / "small" / f"{name}.onnx")
    feeds = sample_inputs(recipe.inputs, 0)
    rows, ref, ref_kind = [], None, None
    for kind in kinds:
        try:
            m = _model_for(kind.split("+")[0], model, recipe)
            # "int8-static+fp16": the int8 model with AMP fp16 on its float parts
            precision = kind if kind in ("fp16", "bf16") else kind.split("+")[1] if "+" in kind else "fp32"
            sess = InferenceSession(m, target="cuda", options={"cuda_graph": True, "precision": precision})
            out = np.asarray(sess.run(None, feeds)[0], np.float64)
            ref, ref_kind = (out, kind) if ref is None else (ref, ref_kind)
            rows.append({"case": case, "impl": f"powerfusion {kind}", "device_time_s": _device_time(sess),
                         "max_rel_error_vs_fp32": float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)),
                         "error_reference": f"powerfusion {ref_kind}"})
            if kind.startswith("int8"):
                rows[-1]["int8_gemms"] = _int8_gemms(sess)
        except Exception:
            rows.append({"case": case, "impl": f"powerfusion {kind}", "error": traceback.format_exc(limit=3)[-800:]})
        _print(rows[-1])
    module = recipe.module.eval().cuda() if torch_kinds else None
    for label, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        if label not in torch_kinds:
            continue
        mod = module.to(dtype)
        args = tuple(torch.from_numpy(feeds[s.name]).cuda().to(dtype) if feeds[s.name].dtype.kind == "f"
                     else torch.from_numpy(feeds[s.name]).cuda() for s in recipe.inputs)
        with torch.no_grad():
            compiled = torch.compile(mod, dynamic=False)
            out = compiled(*args)
            out = (out[0] if isinstance(out, (tuple, list)) else out).float().cpu().numpy().astype(np.float64)
            t = time_torch(compiled, [args], latency_calls=10)
        err = None if ref is None else float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        rows.append({"case": case, "impl": f"torch.compile {label}", "device_time_s": t.device_time_s,
                     "max_rel_error_vs_fp32": err})
        _print(rows[-1])
    return rows


def _print(r: dict) -> None:
    print(f"{r['case']:20s} {r['impl']:26s} " + (f"{r['device_time_s'] * 1e6:9.1f} us  err {r['max_rel_error_vs_fp32']}"
          f"  {r.get('int8_gemms', '')}" if "device_time_s" in r else r["error"][-300:]), flush=True)


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
            "int8_static_over_our_fp16": geo("powerfusion int8-static", "powerfusion fp16"),
            "int8_dynamic_over_our_fp16": geo("powerfusion int8-dynamic", "powerfusion fp16"),
            "int8_static_amp_fp16_over_our_fp16": geo("powerfusion int8-static+fp16", "powerfusion fp16"),
            "int8_dynamic_amp_fp16_over_our_fp16": geo("powerfusion int8-dynamic+fp16", "powerfusion fp16")}


def main(argv=None) -> int:
    from harness import run_metadata, write_results
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="comma-separated substrings of the model names to run")
    ap.add_argument("--kinds", default=",".join(OURS), help="our precisions to run (comma-separated)")
    ap.add_argument("--torch-kinds", default="fp32,fp16,bf16", help="torch.compile dtypes to run")
    ap.add_argument("--bert-layers", type=int, default=4)
    ap.add_argument("--bert-shapes", default="1x128", help="batch x sequence of bert_base_like (comma-separated)")
    ap.add_argument("--other-kinds", default=None, help="our precisions for every case after the first (default --kinds)")
    ap.add_argument("--resnet-blocks", default="3,4,6,3", help="bottlenecks per stage of resnet50_like")
    args = ap.parse_args(argv)
    rows = []
    kinds, torch_kinds = tuple(args.kinds.split(",")), tuple(k for k in args.torch_kinds.split(",") if k)
    blocks = tuple(int(b) for b in args.resnet_blocks.split(","))
    other = tuple(args.other_kinds.split(",")) if args.other_kinds else kinds
    cases = [(name, shape) for name in ("bert_base_like", "resnet50_like", *CNNS)
             if any(part in name for part in args.only.split(","))
             for shape in ([tuple(int(v) for v in s.split("x")) for s in args.bert_shapes.split(",")]
                           if name == "bert_base_like" else [(1, 128)])]
    for i, (name, shape) in enumerate(cases):
        rows += bench(name, kinds if i == 0 else other, torch_kinds, args.bert_layers, blocks, shape)
    shapes = {"bert_layers": args.bert_layers, "bert_shapes": args.bert_shapes} \
        if any(r["case"].startswith("bert_base_like") for r in rows) else {}
    if any(r["case"] == "resnet50_like" for r in rows):
        shapes["resnet_blocks"] = list(blocks)
    meta = run_metadata(suite="precision", geomean=summary(rows), **shapes)
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
