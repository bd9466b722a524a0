"""CPU latency of the CPU session (generated C + numpy BLAS) against onnxruntime (CPU provider).

    PYTHONPATH=$PWD python3 benchmarks/bench_cpu_latency.py [--threads 2] [--models light_vgg19,bert_small]
        [--exports build/cpu-zoo] [--export-python PYTHON]

Models: the bundled small models (models/small, manifest inputs); the CNNs shipped inside
the onnx package (onnx/backend/test/data/light/light_*.onnx, named so here; their ConstantOfShape weight
fills are replaced by random He-scaled weights, batch 1, 224x224); and models exported from
torchvision and transformers (zoo_models.CPU_SET: ResNet-18/50, MobileNetV2, MobileNetV3-small,
EfficientNet-B0, DenseNet-121, ConvNeXt-T, ViT-B/16, BERT-base and GPT-2 at 128 tokens; random
calibrated weights, batch 1, fp32, as zoo_models exports them). Those are read from
`--exports`; missing ones are exported there first by `--export-python` (a python with torch,
torchvision and transformers; by default this one), so the timing process needs no torch.
Their feeds: a standard normal image, token ids uniform in [0, 1000). Both runtimes use the same
thread count (onnxruntime: intra_op_num_threads; ours: OMP_NUM_THREADS and the BLAS's threads,
set before numpy loads). Runs come in three alternating blocks per runtime (see measure),
median wall time per run, each block after one warm-up; per-step times (library calls and memory-bound
subgraphs) of the three models with the worst ratio. Outputs are checked against onnxruntime:
max |diff| / max |onnxruntime| per output. Writes benchmarks/results/cpu-latency.{json,md}
(or `--out`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BLOCKS = 3
LIGHT = ("resnet50", "densenet121", "squeezenet", "shufflenet", "inception_v1", "inception_v2", "bvlc_alexnet",
         "zfnet512", "vgg19")


def set_threads(n: int) -> None:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


def light_model(name: str):
    """The onnx package's light_<name> with random weights, and a random input."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    model = onnx.load(path)
    rng = np.random.default_rng(0)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    keep, new = [], []
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in inits[node.input[0]])
            if len(shape) >= 2:   # He-scaled weights; 1-D (BatchNorm) parameters positive
                v = rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / np.prod(shape[1:])))
            else:
                v = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            new.append(numpy_helper.from_array(v, node.output[0]))
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    model.graph.initializer.extend(new)
    model.ir_version = max(model.ir_version, 4)
    # weights listed as graph inputs too (IR 3) would keep onnxruntime from folding them
    inits = {t.name for t in model.graph.initializer}
    kept = [vi for vi in model.graph.input if vi.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    inp = kept[0]
    shape = tuple(d.dim_value for d in inp.type.tensor_type.shape.dim)
    return model, {inp.name: rng.standard_normal(shape).astype(np.float32)}


def zoo_model(name: str, exports: Path, python: str):
    """An exported torchvision/transformers model (exported first if missing) and its feeds."""
    import numpy as np
    import onnx
    from zoo_models import export_name
    path = exports / export_name(name, 1, "fp32")
    if not path.exists():
        subprocess.run([python, str(ROOT / "benchmarks" / "zoo_models.py"), str(exports), name], check=True)
    model = onnx.load(path)
    rng = np.random.default_rng(0)
    feeds = {}
    inits = {t.name for t in model.graph.initializer}
    for vi in (v for v in model.graph.input if v.name not in inits):
        shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        if vi.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 1000, size=shape, dtype=np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return model, feeds


def small_models() -> dict:
    from models.onnx_tools import TensorSpec, sample_inputs
    import onnx
    manifest = json.loads((ROOT / "models" / "small" / "manifest.json").read_text())["models"]
    return {name: (lambda e=e: (onnx.load(ROOT / "models" / "small" / e["file"]),
                                sample_inputs([TensorSpec.from_json(d) for d in e["inputs"]], seed=0)))
            for name, e in sorted(manifest.items())}


def timed(fn, runs: int, budget_s: float, after=lambda: None) -> list[float]:
    """Wall times of up to `runs` calls after one warm-up (stopping after `budget_s`, 2 at least);
    `after()` runs after each timed call."""
    fn()
    times, start = [], time.perf_counter()
    for k in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        after()
        if k >= 1 and time.perf_counter() - start > budget_s:
            break
    return times


def measure(name: str, load, threads: int, runs: int, budget_s: float) -> dict:
    import numpy as np
    import onnxruntime as ort
    from powerfusion import InferenceSession
    model, feeds = load()
    t0 = time.perf_counter()
    ours = InferenceSession(model)
    create_s = time.perf_counter() - t0
    per_step: dict[str, list[float]] = {}
    got = ours.run(None, feeds)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    want = ref.run(None, feeds)
    # blocks of runs, alternating: load from other processes hits both, and neither's threads
    # share a block with the other's (onnxruntime's pool spins after each run and took the
    # cores from ours when single runs alternated: bert_small 1.2 ms alone, 300 ms interleaved)
    t_ours, t_ort = [], []
    for _ in range(BLOCKS):
        t_ours += timed(lambda: ours.run(None, feeds), runs // BLOCKS, budget_s / BLOCKS / 2,
                        lambda: [per_step.setdefault(n, []).append(sec) for n, sec in ours.profile])
        time.sleep(0.2)
        t_ort += timed(lambda: ref.run(None, feeds), runs // BLOCKS, budget_s / BLOCKS / 2)
        time.sleep(0.2)
    err = max(float(np.max(np.abs(g.astype(np.float64) - w))) / max(float(np.max(np.abs(w))), 1e-30)
              for g, w in zip(got, want))
    kinds = {s.name: "subgraph" for s in ours.partition.subgraphs}
    paths = ours.subgraph_paths
    worst = sorted(((statistics.median(v), n) for n, v in per_step.items()), reverse=True)[:5]
    row = {"model": name, "powerfusion_ms": statistics.median(t_ours) * 1e3, "onnxruntime_ms": statistics.median(t_ort) * 1e3,
           "powerfusion_min_ms": min(t_ours) * 1e3, "onnxruntime_min_ms": min(t_ort) * 1e3,
           "runs": len(t_ours), "create_s": round(create_s, 2), "max_rel_err": err,
           "paths": sorted(set(paths.values())), "fallbacks": ours.fallbacks,
           "slowest_steps": [{"step": n, "kind": kinds.get(n, "library"), "ms": s * 1e3} for s, n in worst]}
    row["ratio"] = row["powerfusion_ms"] / row["onnxruntime_ms"]
    return row


def write(rows: list[dict], threads: int, load_start: float, out: Path) -> None:
    import math
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    def geomean(values):
        values = list(values)
        return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
    geo = geomean(r["ratio"] for r in rows)
    geo_min = geomean(r["powerfusion_min_ms"] / r["onnxruntime_min_ms"] for r in rows)
    exported = [r for r in rows if r.get("set") == "exported"]
    geo_exp = geomean(r["ratio"] for r in exported)
    geo_exp_min = geomean(r["powerfusion_min_ms"] / r["onnxruntime_min_ms"] for r in exported)
    meta = {"device": f"{os.cpu_count()}-core CPU ({_cpu_name()})", "threads": threads, "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg_1min": os.getloadavg()[0],
            "load_avg_1min_start": load_start,
            "geomean_ratio": geo, "worst_ratio": max(r["ratio"] for r in rows), "geomean_min_ratio": geo_min,
            "exported_geomean_ratio": geo_exp, "exported_geomean_min_ratio": geo_exp_min}
    out.with_suffix(".json").write_text(json.dumps({**meta, "models": rows}, indent=1) + "\n")
    lines = [f"# CPU latency: PowerFusion (target cpu) vs onnxruntime", "",
             f"{meta['date']}, commit {commit}, {meta['device']}, {threads} threads each, load average "
             f"{load_start:.1f} at the start and {meta['load_avg_1min']:.1f} at the end: other processes share the cores, "
             "so medians of runs under a few ms move by up to 2x between runs. Median over three alternating blocks of "
             "runs per runtime, batch 1.", "",
             f"Geomean ratio **{geo:.2f}x**, worst {meta['worst_ratio']:.2f}x; of the fastest runs {geo_min:.2f}x.", "",
             f"The {len(exported)} models exported from torchvision/transformers (set `exported`): geomean "
             f"**{geo_exp:.2f}x**, worst {max((r['ratio'] for r in exported), default=float('nan')):.2f}x; "
             f"of the fastest runs {geo_exp_min:.2f}x.", "",
             "Min columns: the fastest run of each, less subject to preemption by other processes (a run longer than",
             "the scheduler's time slice is likely to be preempted once when the cores are oversubscribed).", "",
             "| model | set | powerfusion (ms) | onnxruntime (ms) | ratio | min: powerfusion | min: onnxruntime | min ratio | max rel. err | runs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r.get('set', '')} | {r['powerfusion_ms']:.2f} | {r['onnxruntime_ms']:.2f} | {r['ratio']:.2f}x | "
              f"{r['powerfusion_min_ms']:.2f} | {r['onnxruntime_min_ms']:.2f} | "
              f"{r['powerfusion_min_ms'] / r['onnxruntime_min_ms']:.2f}x | {r['max_rel_err']:.1e} | {r['runs']} |" for r in rows]
    lines += ["", "Slowest steps of the three worst ratios (median ms per run):", ""]
    for r in sorted(rows, key=lambda r: -r["ratio"])[:3]:
        steps = ", ".join(f"{s['step']} ({s['kind']}) {s['ms']:.2f}" for s in r["slowest_steps"])
        lines.append(f"- {r['model']} ({r['ratio']:.2f}x): {steps}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30, help="per runtime, over all blocks")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timed runs per model, at most")
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-latency",
                    help="results path without suffix (.json and .md are written); another path for a "
                         "subset, so that the suite's current results stay whole")
    ap.add_argument("--exports", type=Path, default=ROOT / "build" / "cpu-zoo",
                    help="folder of the torchvision/transformers exports (written if missing)")
    ap.add_argument("--export-python", default=sys.executable,
                    help="python with torch, torchvision and transformers, for missing exports")
    args = ap.parse_args(argv)
    set_threads(args.threads)   # before numpy / the BLAS / OpenMP load
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo_models import CPU_SET
    # the onnx package's CNNs as light_<name> (resnet50 and densenet121 are exported models too)
    loaders = {**small_models(), **{f"light_{n}": (lambda n=n: light_model(n)) for n in LIGHT},
               **{n: (lambda n=n: zoo_model(n, args.exports, args.export_python)) for n in CPU_SET}}
    names = [n for n in args.models.split(",") if n] or list(loaders)
    rows, load_start = [], os.getloadavg()[0]
    for name in names:
        row = measure(name, loaders[name], args.threads, args.runs, args.budget)
        row["set"] = "exported" if name in CPU_SET else "onnx light" if name.startswith("light_") else "bundled"
        print(json.dumps(row), flush=True)
        rows.append(row)
    write(rows, args.threads, load_start, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
