"""Whole committed models on the GPU: PowerFusion against torch eager and torch.compile.

    PYTHONPATH=$PWD python3 benchmarks/bench_models.py --out DIR [--only NAME]

Models: the committed small CNNs (models/small/*.onnx) whose torch modules need only torch
(the recipes in models/, rebuilt with the same seeds): ShuffleNet, EfficientNet, ResNet,
SAR-DRN, RedNet. BERT, GPT-2 and ViT need `transformers`, which the GPU machine lacks, so
they get no row here (their correctness on CUDA is covered by the GPU tests).

Per model and implementation: device time and per-call latency, and kernel launches.
- ours: `InferenceSession(onnx, target="cuda", options={"cuda_graph": True})`; device time
  of back-to-back replays of the captured run between CUDA events (median of 30; MatMul / Conv library
  calls are captured through our own cuBLAS handle where they can be, any other runs eagerly
  between captured pieces and its launch gaps count; `timing_method` says how many), latency =
  wall time of `sess.run` with numpy inputs (host copies included), median;
- torch eager / torch.compile (default mode, dynamic=False): harness.time_torch (CUDA-graph
  replay; latency of a call plus synchronize).
Weights: the recipe's seeded random weights. `max_rel_diff_vs_torch` compares our output with
torch eager's; the ONNX files were exported with the same recipes (another torch version may
initialise differently: a large figure then means different weights, and ours is checked
against onnxruntime in the GPU tests instead).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CNNS = {"shufflenet_small": "shufflenet", "efficientnet_small": "efficientnet", "resnet_small": "resnet",
        "sardrn_small": "sardrn", "rednet_small": "rednet"}


def _ours(name: str, feeds: dict):
    import cupy
    from powerfusion import InferenceSession
    sess = InferenceSession(str(ROOT / "models" / "small" / f"{name}.onnx"), target="cuda",
                            options={"cuda_graph": True})
    out = sess.run(None, feeds)[0]
    times = graph_replay_times(sess)
    lat = []
    for _ in range(30):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        lat.append(time.perf_counter() - t0)
    runner = sess._executor
    plan = runner.plan
    kernels = sum(len(s.kernels) for s in plan.kernel_steps) + (len(plan.steps) - len(plan.kernel_steps))
    library = [s.call.node.name for s in plan.library_steps]
    captured = sum(n in runner._direct for n in library)
    method = f"cuda-graph replay ({captured} of {len(library)} library calls captured, the rest eager)"
    return out, statistics.median(times), statistics.median(lat), kernels, method


def bench(name: str) -> list[dict]:
    import torch
    from harness import count_torch_kernels, time_torch
    from models.export import sample_inputs
    recipe = getattr(importlib.import_module(f"models.{CNNS[name]}"), f"{CNNS[name]}_recipe")(small=True)
    feeds = sample_inputs(recipe.inputs, 0)
    module = recipe.module.eval().cuda()
    args = tuple(torch.from_numpy(feeds[s.name]).cuda() for s in recipe.inputs)
    rows = []
    ours, dev, lat, k, method = _ours(name, feeds)
    with torch.no_grad():
        ref = module(*args)
        ref = (ref[0] if isinstance(ref, (tuple, list)) else ref).float().cpu().numpy()
        diff = float(np.max(np.abs(ours.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))
        rows.append({"case": name, "impl": "powerfusion", "device_time_s": dev, "latency_s": lat, "kernels": k,
                     "timing_method": method, "max_rel_diff_vs_torch": diff})
        compiled = torch.compile(module, dynamic=False)
        for impl, fn in (("torch-eager", module), ("torch-compile", compiled)):
            t = time_torch(fn, [args], latency_calls=30)
            rows.append({"case": name, "impl": impl, "device_time_s": t.device_time_s, "latency_s": t.latency_s,
                         "kernels": count_torch_kernels(fn, args), "timing_method": t.method})
    return rows


def main(argv=None) -> int:
    from harness import run_metadata, write_results
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    from harness import torch_cuda_missing
    if torch_cuda_missing("bench_models"):
        return 2
    rows = []
    for name in CNNS:
        if args.only not in name:
            continue
        try:
            rows += bench(name)
        except Exception:
            traceback.print_exc()
            rows.append({"case": name, "impl": "powerfusion", "error": traceback.format_exc(limit=2)[-600:]})
        for r in rows[-3:]:
            print(f"{r['case']:20s} {r['impl']:14s} " + (f"{r['device_time_s'] * 1e6:9.1f} us device "
                  f"{r['latency_s'] * 1e6:9.1f} us latency  k={r['kernels']}" if "device_time_s" in r else r["error"]),
                  flush=True)
    meta = run_metadata(suite="models")
    for r in rows:   # the table the harness writes expects these fields
        r.setdefault("dtype", "float32")
        r.setdefault("shape", "")
        r.setdefault("bytes", 0)
        r.setdefault("bw_fraction", float("nan"))
    write_results("models", rows, meta, args.out)
    return 0


def graph_replay_times(sess, repeats: int = 30, per_sample: int = 20) -> list[float]:
    """Seconds per replay of a cuda_graph session's captured run: `repeats` samples, each of
    `per_sample` back-to-back replays between two events, as harness.time_torch times torch's
    graphs (launch latency and host gaps amortised the same way on both sides)."""
    import cupy
    runner = sess._executor
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    with cupy.cuda.Device(runner.device_id):
        for _ in range(repeats):
            start.record()
            for _ in range(per_sample):
                runner._replay()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / per_sample)
    return times


if __name__ == "__main__":
    sys.exit(main())

