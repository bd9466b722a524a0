"""Where int8's time goes on the GPU: BERT-base-like layers kernel by kernel, ours in fp16 and int8.

    PYTHONPATH=$PWD python3 benchmarks/profile_int8.py --out DIR [--layers 1] [--shapes 1x128,8x128]

bench_precision.bert_base_like with `--layers` layers at each `--shapes` batch x sequence; our
fp16 and int8 variants as bench_precision names them (int8-static: onnxruntime's default Q/DQ on
every op; int8-gemms: Q/DQ only on the inputs of GEMMs with constant weights; "+fp16": AMP on
the float parts); per variant the median device time of a CUDA-graph replay (as
bench_precision) and one replay profiled kernel by kernel (kernel_profile.py: names and
microseconds in launch order). The GEMMs are timed inside the graph, as they run, not alone
(back-to-back calls from Python measure the host's launch rate at these sizes).
Writes DIR/int8_profile.json after each shape.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def layer_profiles(layers: int, batch: int, seq: int, kinds: list[str]) -> list[dict]:
    import cupy
    from bench_models import graph_replay_times
    from bench_precision import _int8_gemms, _model_for, bert_base_like
    from kernel_profile import profile_calls, summarize

    from models.export import sample_inputs
    from powerfusion import InferenceSession
    recipe, model = bert_base_like(layers, batch, seq)
    feeds = sample_inputs(recipe.inputs, 0)
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        row = {"batch": batch, "seq": seq, "layers": layers, "impl": kind}
        try:
            m = _model_for(kind.split("+")[0], model, recipe)
            precision = kind if kind in ("fp16", "bf16") else kind.split("+")[1] if "+" in kind else "fp32"
            sess = InferenceSession(m, target="cuda", options={"cuda_graph": True, "precision": precision})
            sess.run(None, feeds)
            row["build_s"] = time.perf_counter() - t0
            row["device_us"] = statistics.median(graph_replay_times(sess)) * 1e6
            runner = sess._executor
            with cupy.cuda.Device(runner.device_id):
                recs = profile_calls(runner._replay, calls=1, synchronize=cupy.cuda.Device().synchronize)
            row["summary"] = summarize(recs, 1)
            row["kernels"] = [[r.name[:100], round(r.us, 2)] for r in recs]
            if kind.startswith("int8"):
                row["int8_gemms"] = _int8_gemms(sess)
        except Exception:
            row["error"] = traceback.format_exc(limit=4)[-1500:]
        print({k: v for k, v in row.items() if k not in ("kernels", "summary")}, flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--shapes", default="1x128,8x128", help="batch x seq, comma-separated")
    ap.add_argument("--kinds", default="fp16,int8-static,int8-gemms+fp16,int8-gemms")
    ap.add_argument("--large-kinds", default="fp16,int8-gemms+fp16", help="kinds at every shape after the first")
    args = ap.parse_args(argv)
    out = Path(args.out) / "int8_profile.json"
    result: dict = {}

    def save():
        out.write_text(json.dumps(result, indent=1, default=str))
    result["layers"] = []
    for i, shape in enumerate(args.shapes.split(",")):
        batch, seq = (int(v) for v in shape.split("x"))
        kinds = (args.kinds if i == 0 else args.large_kinds).split(",")
        result["layers"] += layer_profiles(args.layers, batch, seq, kinds)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
