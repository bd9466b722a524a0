"""Where a cold session build goes on the GPU host (a diagnostic for the zoo's build times).

    PYTHONPATH=$PWD python3 benchmarks/diag/build_profile.py --out DIR vit_b_16:fp32 gpt2:fp32 ...

For each model:dtype of the zoo (`benchmarks/zoo_models.py`, exported here if not in
build/zoo-onnx), each in a process of its own with an empty kernel and plan cache:
`InferenceSession(target="cuda", cuda_graph)` plus the first run, as bench_zoo.py's "build s"
takes it. Writes DIR/build_profile.json: per model the total seconds, the seconds of the
build's parts (timers around the functions in PARTS; parts nest) and the search's timeline
(each distinct subgraph's search in its worker process). No cProfile: a forked worker
inherits the profiler (on Python 3.12 through sys.monitoring) and searches ~3x slower.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

# (label, module, attribute) of the build's parts; each timed where it is called from (every
# loaded powerfusion module's reference to the function is replaced by a timed one)
PARTS = (
    ("compile (import, partition, search, codegen)", "powerfusion.pipeline.driver", "compile"),
    ("plan search", "powerfusion.pipeline.parallel", "search_all"),
    ("CUDA plan runner (kernels, libraries, cuDNN)", "powerfusion.backends.cuda.session", "CudaPlanRunner.__init__"),
    ("NVRTC (all kernels at once)", "powerfusion.backends.cuda.runtime", "precompile_sources"),
    ("cuDNN convolutions (graphs, plan timing)", "powerfusion.backends.cuda.cudnn_conv", "plan_convs"),
    ("first run (CUDA-graph capture)", "powerfusion.session", "InferenceSession.run_bound"),
)


def _timed_parts() -> dict:
    """Wrap each part's function in a timer (parent process only); returns the totals dict."""
    import functools
    import importlib
    totals = {label: 0.0 for label, _, _ in PARTS}
    for label, module, attr in PARTS:
        mod = importlib.import_module(module)
        owner, name = (mod, attr) if "." not in attr else (getattr(mod, attr.split(".")[0]), attr.split(".")[1])
        fn = getattr(owner, name)

        def timed(*a, __fn=fn, __label=label, **k):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                totals[__label] += time.perf_counter() - t0

        timed = functools.wraps(fn)(timed)
        setattr(owner, name, timed)
        if owner is mod:   # names imported elsewhere (`from ... import compile`)
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("powerfusion") and getattr(other, name, None) is fn:
                    setattr(other, name, timed)
    return totals


def _log_searches(folder: Path) -> None:
    """Each search (in whichever forked worker) appends pid, start, end, subgraph, ops to a file."""
    from powerfusion.pipeline import parallel
    inner = parallel._searched

    def timed(sub, graph, t, cache, search_kw):
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


def profile_one(name: str, dtype: str, exports: Path, gc_freeze: bool = True) -> dict:
    import cupy
    import zoo_models

    import powerfusion.backends.cuda.session  # noqa: F401 - loaded before its parts are wrapped
    from powerfusion import InferenceSession
    path = exports / zoo_models.export_name(name, 1, dtype)
    built = zoo_models.build(name, 1, dtype)
    if not path.exists():
        exports.mkdir(parents=True, exist_ok=True)
        zoo_models.export(built, path, dtype)
    feeds = dict(zip(built.names, built.args))
    timeline = Path(tempfile.mkdtemp(prefix="pf-searches-"))
    _log_searches(timeline)
    totals = _timed_parts()
    if not gc_freeze:   # A/B: the search's workers forked without the parent's heap frozen
        import types

        from powerfusion.pipeline import parallel
        parallel.gc = types.SimpleNamespace(freeze=lambda: None, unfreeze=lambda: None)
    t_wall = time.time()
    t0 = time.perf_counter()
    sess = InferenceSession(str(path), target="cuda", options={"cuda_graph": True})
    wanted = {sess.graph.outputs[0].name: ("cuda", None)}
    sess.run_bound(feeds, wanted)
    cupy.cuda.Device().synchronize()
    total = time.perf_counter() - t0
    return {"model": name, "dtype": dtype, "gc_freeze": gc_freeze, "build_s": round(total, 3),
            "parts_s": {k: round(v, 3) for k, v in totals.items()},
            "search_timeline": _search_timeline(timeline, t_wall)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="model:dtype[:nofreeze] (zoo names; nofreeze: the search's "
                                             "workers forked without gc.freeze, for an A/B)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--exports", type=Path, default=ROOT / "build" / "zoo-onnx")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:   # in a process of its own, with an empty cache folder (the parent's doing)
        import cupy
        cupy.arange(4).sum()   # CUDA context before the timing
        name, dtype, *flags = args.cases[0].split(":")
        try:
            row = profile_one(name, dtype, args.exports, gc_freeze="nofreeze" not in flags)
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
        print(json.dumps(row), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "build_profile.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
