"""CPU latency of the CPU session against onnxruntime (CPU) on the bundled BERT-size model.

    PYTHONPATH=$PWD python3 benchmarks/bench_cpu_latency.py [--model models/small/bert_small.onnx]
Median wall time per run over repeated runs after warm-up; writes benchmarks/results/cpu-latency.json/.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def median_time(fn, runs=20) -> float:
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv=None) -> int:
    import onnx
    import onnxruntime as ort

    from models.onnx_tools import TensorSpec, sample_inputs
    from powerfusion import InferenceSession
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "small" / "bert_small.onnx"))
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args(argv)
    manifest = json.loads((ROOT / "models" / "small" / "manifest.json").read_text())["models"]
    entry = next(e for e in manifest.values() if e["file"] == Path(args.model).name)
    feeds = sample_inputs([TensorSpec.from_json(d) for d in entry["inputs"]], seed=0)
    ours = InferenceSession(args.model)
    ref = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    t_ours = median_time(lambda: ours.run(None, feeds), args.runs)
    t_ort = median_time(lambda: ref.run(None, feeds), args.runs)
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    row = {"model": Path(args.model).name, "powerfusion_cpu_s": t_ours, "onnxruntime_cpu_s": t_ort,
           "ratio_ours_over_ort": t_ours / t_ort, "runs": args.runs, "cpus": os.cpu_count(),
           "load_avg": os.getloadavg()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit}
    out = ROOT / "benchmarks" / "results" / "cpu-latency"
    out.with_suffix(".json").write_text(json.dumps(row, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"# CPU latency\n\n{row['date']}, commit {commit}, {row['cpus']} cores (load average {row['load_avg']:.1f})\n\n"
        "| model | powerfusion (ms) | onnxruntime (ms) | ratio |\n|---|---:|---:|---:|\n"
        f"| {row['model']} | {t_ours * 1e3:.2f} | {t_ort * 1e3:.2f} | {row['ratio_ours_over_ort']:.1f}x |\n")
    print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
