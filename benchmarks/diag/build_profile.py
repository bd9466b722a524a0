"""Where a cold session build goes on the GPU host (a diagnostic for the zoo's build times).

    PYTHONPATH=$PWD python3 benchmarks/diag/build_profile.py --out DIR vit_b_16:fp32 gpt2:fp32 ...

For each model:dtype of the zoo (`benchmarks/zoo_models.py`, exported here if not in
build/zoo-onnx), with an empty kernel and plan cache: `InferenceSession(target="cuda",
cuda_graph)` plus the first run, as bench_zoo.py's "build s" takes it, under cProfile. Writes
DIR/build_profile.json (per model: total seconds and the cumulative seconds of the build's
parts) and prints the top functions by cumulative time. The search workers are other
processes: their time shows as the parent's wait in the search call (they run unprofiled; each
search's span is logged in the timeline).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

# (label, file suffix, function name) of the parts worth naming; cumulative seconds each
PARTS = (
    ("compile (partition, search, codegen)", "pipeline/driver.py", "compile"),
    ("plan search", "pipeline/parallel.py", "search_all"),
    ("NVRTC compile + load", "backends/cuda/runtime.py", "compile_source"),
    ("NVRTC itself", "cupy/cuda/compiler.py", "compile_using_nvrtc"),
    ("GIR executors", "backends/cuda/executor.py", "__init__"),
    ("cuDNN graphs", "backends/cuda/cudnn_conv.py", None),
    ("first run", "powerfusion/session.py", "run_bound"),
)


def _part_seconds(stats: pstats.Stats) -> dict:
    out = {}
    for label, suffix, fn in PARTS:
        total = 0.0
        for (file, _, name), (_, _, _, ct, callers) in stats.stats.items():
            if not file.replace("\\", "/").endswith(suffix) and suffix not in file:
                continue
            if fn is not None and name != fn:
                continue
            if fn is None and any(suffix in c[0] for c in callers):   # a module: calls from outside
                continue
            total += ct
        out[label] = round(total, 3)
    return out


def _log_searches(folder: Path) -> None:
    """Each search (in whichever forked worker) appends pid, start, end, subgraph, ops to a file."""
    from powerfusion.pipeline import parallel
    inner = parallel._searched
    parent = os.getpid()

    def timed(sub, graph, t, cache, search_kw):
        if os.getpid() != parent:   # a forked worker inherits the parent's profiler: it would run 3x slower
            sys.setprofile(None)
        t0 = time.time()
        try:
            return inner(sub, graph, t, cache, search_kw)
        finally:
            with open(folder / f"searches-{os.getpid()}.txt", "a") as f:
                f.write(f"{os.getpid()} {t0:.3f} {time.time():.3f} {sub.name} {len(sub.nodes)}\n")

    parallel._DECIDERS["search"] = timed


def _search_timeline(folder: Path, t_start: float) -> dict:
    rows = []
    for f in folder.glob("searches-*.txt"):
        for line in f.read_text().splitlines():
            pid, a, b, name, ops = line.split()
            rows.append((int(pid), float(a) - t_start, float(b) - t_start, name, int(ops)))
    if not rows:
        return {"searches": 0}
    longest = max(rows, key=lambda r: r[2] - r[1])
    return {"searches": len(rows), "processes": len({r[0] for r in rows}),
            "first_start_s": round(min(r[1] for r in rows), 2), "last_end_s": round(max(r[2] for r in rows), 2),
            "sum_s": round(sum(r[2] - r[1] for r in rows), 2),
            "longest": [longest[3], longest[4], round(longest[2] - longest[1], 2)]}


def profile_one(name: str, dtype: str, exports: Path) -> dict:
    import cupy
    import zoo_models

    from powerfusion import InferenceSession
    path = exports / zoo_models.export_name(name, 1, dtype)
    built = zoo_models.build(name, 1, dtype)
    if not path.exists():
        exports.mkdir(parents=True, exist_ok=True)
        zoo_models.export(built, path, dtype)
    feeds = dict(zip(built.names, built.args))
    timeline = Path(tempfile.mkdtemp(prefix="pf-searches-"))
    _log_searches(timeline)
    prof = cProfile.Profile()
    t_wall = time.time()
    t0 = time.perf_counter()
    prof.enable()
    sess = InferenceSession(str(path), target="cuda", options={"cuda_graph": True})
    wanted = {sess.graph.outputs[0].name: ("cuda", None)}
    sess.run_bound(feeds, wanted)
    cupy.cuda.Device().synchronize()
    prof.disable()
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    row = {"model": name, "dtype": dtype, "build_s": round(total, 3), "parts_s": _part_seconds(stats),
           "search_timeline": _search_timeline(timeline, t_wall)}
    stats.sort_stats("cumulative")
    top = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:45]:
        top.append({"where": f"{Path(file).name}:{line}:{fn}", "calls": nc, "cum_s": round(ct, 3),
                    "own_s": round(tt, 3)})
    row["top"] = top
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="model:dtype (zoo names)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--exports", type=Path, default=ROOT / "build" / "zoo-onnx")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:   # in a process of its own, with an empty cache folder (the parent's doing)
        import cupy
        cupy.arange(4).sum()   # CUDA context before the timing
        name, dtype = args.cases[0].split(":")
        try:
            row = profile_one(name, dtype, args.exports)
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            row = {"model": name, "dtype": dtype, "error": f"{type(e).__name__}: {e}"[:400]}
        args.one.write_text(json.dumps(row))
        return 0
    rows = []
    for case in args.cases:
        with tempfile.TemporaryDirectory(prefix="pf-build-") as tmp:
            env = {**os.environ, "POWERFUSION_CACHE_DIR": str(Path(tmp) / "cache")}
            res = Path(tmp) / "row.json"
            proc = subprocess.run([sys.executable, __file__, case, "--out", str(args.out), "--exports",
                                   str(args.exports), "--one", str(res)], check=False, env=env)
            row = json.loads(res.read_text()) if res.exists() else {"case": case, "error": f"rc {proc.returncode}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
        for t in row.get("top", [])[:30]:
            print(f"   {t['cum_s']:8.2f} {t['own_s']:8.2f} {t['calls']:7d}  {t['where']}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "build_profile.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
