"""Cold and warm build time of whole models, `powerfusion compile` per target.

    python3 benchmarks/bench_compile_time.py export --out DIR      # needs the `bench` extra (torch, torchvision, transformers)
    python3 benchmarks/bench_compile_time.py measure --models DIR [--targets cuda cpu] [--label after]

`export` writes the benchmark's models with random weights: torchvision's resnet18,
mobilenet_v2, efficientnet_b0 and densenet121 (as `models/export_zoo.py` exports them: the
TorchScript exporter at opset 17, nothing folded), BERT-base (`models/build.py`, 12 layers,
sequence 128), and one LayerNormalization at 32768 x 1024 and 32768 x 16384 (build time must
not grow with the tensor). The model zoo's transformers and Swin-T (`--only vit_b_16 gpt2 swin_t`)
are read as `benchmarks/zoo_models.py DIR vit_b_16 gpt2 swin_t` writes them (DIR/<name>_b1_fp32.onnx)
where DIR/<name>.onnx is absent. `measure` runs `powerfusion compile MODEL --target T` in a fresh process per
run: cold with an empty cache folder (plan search, rendering), then warm twice with the same
cache and output folders (the compiled result is found by the model's hash and the output
folder is up to date: what a rebuild of an unchanged model costs). Target `cpu-session` times
building `InferenceSession(model, target="cpu")` the same way (the CPU session's default plans
and its C build; warm: plan decisions and compiled C from the cache). The CUDA target needs no
GPU to compile: its plan search ranks plans with the cost model, and nvcc is not run.

Each run records wall seconds, the machine's load average before it, and the per-step
seconds `--timings` prints. Results go to benchmarks/results/compile-time.json and .md; a
`--label` keeps earlier labels' rows in the JSON (e.g. "before" measured at an older commit).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TORCHVISION = ("resnet18", "mobilenet_v2", "efficientnet_b0", "densenet121")
LAYERNORMS = ((32768, 1024), (32768, 16384))   # build time must not grow with the tensor
MODELS = TORCHVISION + ("bert_base",) + tuple(f"layernorm_{r}x{c}" for r, c in LAYERNORMS)
COLD_GOAL_S, WARM_GOAL_S = 30.0, 1.0
SESSION = "cpu-session"   # InferenceSession(model, target="cpu") built in a fresh process
_STEP = re.compile(r"^\s+(\w[\w ]*?)\s+([\d.]+) s\b")   # a --timings line


def export(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from models.export_zoo import export as export_model, torchvision_model
    from models.build import build
    out.mkdir(parents=True, exist_ok=True)
    for name in TORCHVISION:
        model, args, names = torchvision_model(name)
        print(name, export_model(model, args, names, out / f"{name}.onnx"), flush=True)
    build(out, small=False, keys=["bert"])
    for rows, cols in LAYERNORMS:
        layernorm_model(rows, cols, out / f"layernorm_{rows}x{cols}.onnx")


def layernorm_model(rows: int, cols: int, path: Path) -> None:
    """One LayerNormalization over the last axis of a rows x cols float32 input."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    params = [numpy_helper.from_array(rng.standard_normal(cols).astype(np.float32), n) for n in ("scale", "bias")]
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "layernorm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, cols])], params)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def measure_one(model: Path, target: str, cache: Path, out: Path) -> dict:
    load = os.getloadavg()[0]
    if target == SESSION:
        cmd = [sys.executable, "-c", "import sys; from powerfusion import InferenceSession; "
               "InferenceSession(sys.argv[1], target='cpu')", str(model.resolve())]
    else:
        cmd = [sys.executable, "-m", "powerfusion.cli", "compile", str(model.resolve()), "--target", target,
               "-o", str(out), "--timings", "-q"]
    env = {**os.environ, "POWERFUSION_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    t0, cpu0 = time.perf_counter(), _children_cpu()
    # cwd: `python -m` puts the working folder ahead of PYTHONPATH (ROOT's powerfusion must be the one run)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:], "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2), "load": load}
    steps = {m.group(1): float(m.group(2)) for m in map(_STEP.match, r.stdout.splitlines()) if m}
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load": round(load, 2), "steps": steps}


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (the compile and its search
    workers): on a shared machine wall time follows the load, CPU time much less."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(models: Path, targets: list[str], names: list[str], warm_runs: int = 2) -> list[dict]:
    rows = []
    for name in names:
        path = models / f"{name}.onnx"
        if not path.exists():   # as zoo_models.py names its exports
            path = models / f"{name}_b1_fp32.onnx"
        for target in targets:
            cache = Path(tempfile.mkdtemp(prefix="pf-bench-cache-"))
            out = cache / "out"   # one output folder: a warm compile finds it up to date
            try:
                cold = measure_one(path, target, cache / "cache", out)
                warm = [measure_one(path, target, cache / "cache", out) for _ in range(warm_runs)]
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            row = {"model": name, "target": target, "cold": cold, "warm": warm}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "powerfusion"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def write(rows: list[dict], label: str, workers: str, commit: str | None = None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "compile-time.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    runs = doc.get("runs", {})
    runs[label] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "commit": commit or _commit(), "machine": f"{os.cpu_count()} cores, {platform.machine()}, no GPU, "
                   f"Python {platform.python_version()}", "search_workers": workers, "rows": rows}
    doc = {"suite": "compile time, powerfusion compile per target", "goals": {"cold_s": COLD_GOAL_S,
           "warm_s": WARM_GOAL_S}, "runs": runs}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "compile-time.md").write_text(markdown(doc))


def markdown(doc: dict) -> str:
    out = ["# Compile time (`powerfusion compile`), cold and warm", "",
           f"Goals: cold <= {COLD_GOAL_S:g} s, warm <= {WARM_GOAL_S:g} s per model on a 2-core machine. "
           "Cold: empty cache folder; warm: the same cache and output folders again (two runs). Load: the 1-minute load "
           "average before the run (the machine is shared; wall time rises with it). CPU: user + "
           "system seconds of the compile process and its search workers (less sensitive to the load; "
           "with two workers the wall time of an idle 2-core machine is about half of it).", ""]
    for label, run in doc["runs"].items():
        out += [f"## {label}: commit {run['commit']}, {run['date']}, {run['machine']}, "
                f"search workers {run['search_workers']}", "",
                "| model | target | cold wall (s) | cold CPU (s) | search (s) | load | warm wall (s) |",
                "|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            c = r["cold"]
            cold = f"error: {c['error']}" if "error" in c else f"{c['wall_s']:.1f}"
            warm = ", ".join(f"{w['wall_s']:.2f}" for w in r["warm"])
            out.append(f"| {r['model']} | {r['target']} | {cold} | {c.get('cpu_s', float('nan')):.1f} "
                       f"| {c.get('steps', {}).get('search', float('nan')):.1f} "
                       f"| {c['load']:.1f} | {warm} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", required=True, type=Path)
    m = sub.add_parser("measure")
    m.add_argument("--models", required=True, type=Path)
    m.add_argument("--targets", nargs="+", default=["cuda", "cpu"])
    m.add_argument("--only", nargs="+", default=list(MODELS))
    m.add_argument("--label", default="current")
    m.add_argument("--commit", help="the commit measured, where this tree is not a git checkout")
    args = ap.parse_args()
    if args.cmd == "export":
        export(args.out)
        return 0
    rows = measure(args.models, args.targets, args.only)
    write(rows, args.label, os.environ.get("POWERFUSION_SEARCH_WORKERS", "default"), args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
