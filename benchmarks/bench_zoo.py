"""Model zoo on the GPU: PowerFusion against torch eager and torch.compile on whole models.

    PYTHONPATH=$PWD POWERFUSION_GIT_COMMIT=$(git rev-parse --short HEAD) \
        python3 benchmarks/bench_zoo.py [--models resnet18,vit_b_16] [--batches 1,8] [--dtypes fp32,fp16] \
        [--out DIR] [--exports DIR] [--profile vit_b_16,convnext_tiny] [--budget-s 280]

Models (zoo_models.py): ResNet-18/50, MobileNetV3-small, EfficientNet-B0, ConvNeXt-T, ViT-B/16,
Swin-T (torchvision, 224x224), BERT-base, GPT-2 124M (prefill) and a 4-layer LLaMA-style decoder
(transformers, 128 tokens); random weights; exported on the device by torch (zoo_models.export).

Per row (model, batch, dtype, impl):
- build_s: PowerFusion: `InferenceSession(onnx, target="cuda", options={"cuda_graph": True})`
  plus the first run (which captures the graph); torch.compile (default mode, dynamic=False):
  the first call, which compiles; torch eager: 0.
- device_time_s: back-to-back replays of the captured CUDA graph between two events, divided
  by the replays, for every impl (harness.time_torch for torch; bench_models.graph_replay_times
  for ours, which launches the session's captured pieces the same way).
- latency_s: one call with inputs already on the GPU and outputs left there, plus a synchronize
  (median): ours through `run_bound` (onnxruntime's IOBinding path), torch a plain call.
- kernels (launched per call, torch.profiler), library_calls (of those, GEMM / conv library
  kernels, kernel_profile.categorize); ours also `generated_kernels` and `library_steps` from the plan.
- max_rel_err: max |out - torch eager| / max |torch eager| (float64), eager in the same dtype;
  `within_tol` against REL_TOL (fp32 1e-3: cuBLAS and our kernels round differently from
  cuDNN / eager; fp16 3e-2: a few units in the last place of fp16 through 12+ layers).
fp32 runs with TF32 off everywhere (torch matmul and cuDNN), as our cuBLAS calls use none.
A model that fails gets a row per impl saying at which stage and why; the run goes on.
Results are written after every row (a run cut off by its time limit keeps what it measured).
`--profile NAMES` also writes zoo-profile.{json,md}: per-kernel categories of one call, ours
against torch.compile (kernel_profile.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

REL_TOL = {"fp32": 1e-3, "fp16": 3e-2}
IMPLS = ("powerfusion", "torch-eager", "torch-compile")


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _host(t) -> np.ndarray:
    import torch
    if isinstance(t, (tuple, list)):
        t = t[0]
    if isinstance(t, torch.Tensor):
        return t.detach().float().cpu().numpy()
    import cupy
    return cupy.asnumpy(t).astype(np.float32)


def _launch_counts(run, sync=None) -> tuple[int, int, dict]:
    from kernel_profile import profile_calls, summarize
    s = summarize(profile_calls(run, calls=1, synchronize=sync), 1)
    total = sum(int(s["categories"][c]["kernels"]) for c in ("library", "memory-bound", "copies"))
    return total, int(s["categories"]["library"]["kernels"]), s


# ---- ours -------------------------------------------------------------------------------
def run_ours(path: Path, built, ref: np.ndarray, dtype: str) -> tuple[dict, dict]:
    import cupy
    import torch
    from bench_models import graph_replay_times
    from harness import _latency
    from powerfusion import InferenceSession
    row: dict = {"impl": "powerfusion"}
    t0 = time.perf_counter()
    stage = "build"
    try:
        sess = InferenceSession(str(path), target="cuda", options={"cuda_graph": True})
        stage = "run"
        feeds = dict(zip(built.names, built.args))
        wanted = {sess.graph.outputs[0].name: ("cuda", None)}
        out = sess.run_bound(feeds, wanted)[sess.graph.outputs[0].name]
        row["build_s"] = time.perf_counter() - t0
        row["max_rel_err"] = _rel_err(_host(out), ref)
        stage = "time"
        row["device_time_s"] = statistics.median(graph_replay_times(sess))
        row["latency_s"] = _latency(lambda i: sess.run_bound(feeds, wanted), cupy.cuda.Device().synchronize, 30)
        plan = sess._executor.plan
        row["generated_kernels"] = sum(len(s.kernels) for s in plan.kernel_steps)
        row["library_steps"] = len(plan.library_steps)
        runner = sess._executor
        stage = "profile"
        row["kernels"], row["library_calls"], prof = _launch_counts(runner._replay,
                                                                    torch.cuda.synchronize)
        row["timing_method"] = _pieces_note(runner)
        routes = list(getattr(runner, "conv_routes", {}).values())
        row["convs_im2col"] = sum(r.startswith("im2col") for r in routes)   # the rest through cuDNN
        row["convs_cudnn"] = len(routes) - row["convs_im2col"]
        reasons = sorted(set(getattr(runner, "fallbacks", {}).values()))
        if reasons:   # why a library call did not take its fast route (e.g. cuDNN missing)
            row["fallbacks"] = reasons[:3]
            print(f"{path.name}: {len(runner.fallbacks)} fallback(s): {reasons[0]}", flush=True)
        return row, prof
    except Exception as e:
        row["error"] = f"{stage}: {_one_line(e)}"
        traceback.print_exc()
        return row, {"error": row["error"]}


def _pieces_note(runner) -> str:
    kinds = [k for k, _ in runner._cuda_graph]
    eager = kinds.count("eager")
    return f"cuda-graph replay ({kinds.count('graph')} graph pieces, {eager} eager library pieces between)"


# ---- torch ------------------------------------------------------------------------------
def run_torch(impl: str, built, ref: np.ndarray | None) -> tuple[dict, dict, np.ndarray | None]:
    import torch
    from harness import time_torch
    row: dict = {"impl": impl}
    stage = "build"
    try:
        fn = built.module if impl == "torch-eager" else torch.compile(built.module, dynamic=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = _host(fn(*built.args))
            torch.cuda.synchronize()
            row["build_s"] = 0.0 if impl == "torch-eager" else time.perf_counter() - t0
            row["max_rel_err"] = 0.0 if ref is None else _rel_err(out, ref)
            stage = "time"
            t = time_torch(fn, [built.args], latency_calls=30)
            row.update(device_time_s=t.device_time_s, latency_s=t.latency_s, timing_method=t.method)
            stage = "profile"
            prof = _profile_torch_graph(fn, built.args)
            row["kernels"], row["library_calls"] = prof.pop("_counts")
        return row, prof, out
    except Exception as e:
        row["error"] = f"{stage}: {_one_line(e)}"
        traceback.print_exc()
        return row, {"error": row["error"]}, None


def _profile_torch_graph(fn, args) -> dict:
    """Kernels of one call as timed: captured in a CUDA graph and replayed (eager launches where
    the call cannot be captured)."""
    import torch
    from harness import _side_stream_call
    from kernel_profile import profile_calls, summarize
    _side_stream_call(fn, args)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        run = graph.replay
    except Exception:
        run = lambda: fn(*args)  # noqa: E731
    s = summarize(profile_calls(run, calls=1), 1)
    total = sum(int(s["categories"][c]["kernels"]) for c in ("library", "memory-bound", "copies"))
    s["_counts"] = (total, int(s["categories"]["library"]["kernels"]))
    return s


# ---- rows -------------------------------------------------------------------------------
def bench_case(name: str, batch: int, dtype: str, exports: Path, impls) -> tuple[list[dict], dict]:
    """Rows of every impl for one (model, batch, dtype); failures become rows naming the stage."""
    import torch
    import zoo_models
    base = {"case": name, "batch": batch, "dtype": dtype}
    stage = "build the torch module"
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        built = zoo_models.build(name, batch, dtype)
        stage = "export"
        path = exports / f"{name}_b{batch}_{dtype}.onnx"
        exporter = zoo_models.export(built, path, dtype)
    except Exception as e:
        traceback.print_exc()
        err = f"{stage}: {_one_line(e)}"
        return [{**base, "impl": impl, "error": err} for impl in impls], {}
    rows, profiles, ref = [], {}, None
    for impl in ("torch-eager", "torch-compile"):
        if impl in impls or (impl == "torch-eager" and ref is None):
            row, prof, out = run_torch(impl, built, ref)
            if impl == "torch-eager":
                ref = out
            if impl in impls:
                rows.append({**base, **row, "exporter": exporter})
                profiles[impl] = prof
    if "powerfusion" in impls:
        if ref is None:
            rows.append({**base, "impl": "powerfusion", "error": "no torch eager reference"})
        else:
            row, prof = run_ours(path, built, ref, dtype)
            rows.append({**base, **row, "exporter": exporter})
            profiles["powerfusion"] = prof
    for r in rows:
        if "max_rel_err" in r:
            r["within_tol"] = bool(r["max_rel_err"] <= REL_TOL[dtype])
    del built
    torch.cuda.empty_cache()
    return rows, profiles


def geomeans(rows: list[dict]) -> dict:
    """Per dtype: geomean of torch.compile time / our time (and eager / ours) over the rows where
    both were measured; the model count beside it."""
    out = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        for other in ("torch-compile", "torch-eager"):
            ratios = []
            for key in sorted({(r["case"], r["batch"]) for r in rows if r["dtype"] == dtype}):
                t = {r["impl"]: r.get("device_time_s") for r in rows if (r["case"], r["batch"], r["dtype"]) == (*key, dtype)}
                if t.get("powerfusion") and t.get(other):
                    ratios.append(t[other] / t["powerfusion"])
            if ratios:
                out[f"{dtype} {other} / powerfusion"] = {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                                                         "rows": len(ratios), "min": min(ratios)}
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# Model zoo", "", f"{meta.get('device', '?')}, {meta['date']}, commit {meta['git_commit']}, "
             f"torch {meta.get('torch', '?')}. Device time: back-to-back CUDA-graph replays between events; "
             "latency: one call with device inputs and outputs, plus a synchronize (median); "
             "kernels: launched per call (library: GEMM / conv kernels among them); error: max |out - torch eager| "
             "/ max |torch eager|. `benchmarks/bench_zoo.py` says how each figure is taken.", "",
             "| model | batch | dtype | impl | build s | device us | latency us | kernels (library) | max rel err | "
             "compile / impl |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['batch']} | {r['dtype']} | {r['impl']} | failed: "
                         f"{r['error'][:160].replace('|', '/')} | | | | | |")
            continue
        comp = next((x.get("device_time_s") for x in rows if x["impl"] == "torch-compile"
                     and (x["case"], x["batch"], x["dtype"]) == (r["case"], r["batch"], r["dtype"])), None)
        ratio = f"{comp / r['device_time_s']:.2f}" if comp and r.get("device_time_s") else "-"
        lines.append(f"| {r['case']} | {r['batch']} | {r['dtype']} | {r['impl']} | {r.get('build_s', 0):.1f} | "
                     f"{r.get('device_time_s', float('nan')) * 1e6:.0f} | {r.get('latency_s', float('nan')) * 1e6:.0f} | "
                     f"{r.get('kernels', '-')} ({r.get('library_calls', '-')}) | {r.get('max_rel_err', float('nan')):.1e} | "
                     f"{ratio} |")
    lines += ["", "Geomean of torch time / PowerFusion time (> 1: PowerFusion faster):", ""]
    lines += [f"- {k}: {v['geomean']:.2f}x over {v['rows']} rows (lowest {v['min']:.2f}x)"
              for k, v in meta.get("geomean", {}).items()]
    lines += [f"- {n}" for n in meta.get("notes", [])]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], profiles: dict, meta: dict, out: Path) -> None:
    from kernel_profile import markdown as profile_markdown
    meta = {**meta, "geomean": geomeans(rows)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "zoo.md").write_text(markdown(rows, meta))
    if profiles:
        (out / "zoo-profile.json").write_text(json.dumps({"meta": meta, "profiles": profiles}, indent=1) + "\n")
        (out / "zoo-profile.md").write_text(profile_markdown("Model zoo: where the time goes", meta, profiles))


def _one_line(e: BaseException) -> str:
    from zoo_models import one_line
    return one_line(e)


def _csv(text: str, allowed, what: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    unknown = [t for t in items if t not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(allowed)})")
    return items


def main(argv=None) -> int:
    import zoo_models
    from harness import run_metadata
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo_models.MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--profile", default="", help="models whose per-kernel profile goes to zoo-profile.md")
    ap.add_argument("--exports", default=None, help="folder for the exported .onnx files (kept; reused when present)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--merge", action="store_true", help="keep the rows of other cases already in OUT/zoo.json")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new case after this many seconds (0: no limit)")
    args = ap.parse_args(argv)
    models = _csv(args.models, zoo_models.MODELS, "model")
    dtypes = _csv(args.dtypes, REL_TOL, "dtype")
    impls = _csv(args.impls, IMPLS, "impl")
    batches = [int(b) for b in args.batches.split(",") if b]
    profiled = set(_csv(args.profile, zoo_models.MODELS, "model"))
    from harness import torch_cuda_missing
    if torch_cuda_missing("bench_zoo"):
        return 2
    out = Path(args.out)
    exports = Path(args.exports or tempfile.mkdtemp(prefix="zoo-onnx-"))
    exports.mkdir(parents=True, exist_ok=True)
    rows, profiles = _previous(out) if args.merge else ([], {})
    meta = run_metadata(suite="zoo", seq_len=zoo_models.SEQ, image=list(zoo_models.IMAGE), rel_tol=REL_TOL,
                        search_budget_s=os.environ.get("POWERFUSION_SEARCH_BUDGET_S", "default (10)"))
    start = time.perf_counter()
    for name in models:
        for dtype in dtypes:
            for batch in batches:
                if args.budget_s and time.perf_counter() - start > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent: {name} b{batch} {dtype} not run", flush=True)
                    continue
                key = (name, batch, dtype)
                new, prof = bench_case(name, batch, dtype, exports, impls)
                for r in new:   # merged files mix runs: each row says which
                    r.update(git_commit=meta["git_commit"], date=meta["date"])
                rows = [r for r in rows if (r["case"], r["batch"], r["dtype"]) != key] + new
                if name in profiled and prof:
                    profiles[f"{name} b{batch} {dtype}"] = prof
                for r in new:
                    print(_line(r), flush=True)
                write(rows, profiles, meta, out)
    print(json.dumps(geomeans(rows), indent=1))
    return 0


def _previous(out: Path) -> tuple[list[dict], dict]:
    rows = json.loads((out / "zoo.json").read_text())["rows"] if (out / "zoo.json").exists() else []
    prof = (json.loads((out / "zoo-profile.json").read_text())["profiles"]
            if (out / "zoo-profile.json").exists() else {})
    return rows, prof


def _line(r: dict) -> str:
    head = f"{r['case']:18s} b{r['batch']} {r['dtype']} {r['impl']:14s}"
    if "error" in r:
        return f"{head} FAILED {r['error'][:200]}"
    return (f"{head} build {r.get('build_s', 0):6.1f} s  device {r['device_time_s'] * 1e6:9.1f} us  "
            f"latency {r['latency_s'] * 1e6:9.1f} us  kernels {r.get('kernels')} ({r.get('library_calls')})  "
            f"err {r.get('max_rel_err', float('nan')):.1e}")


if __name__ == "__main__":
    sys.exit(main())
