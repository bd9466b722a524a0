"""Do two commits compile a model to the same plans and kernels? (`powerfusion compile` of each)

    python3 benchmarks/diag/compare_compiles.py MODEL.onnx [MODEL2.onnx ...] --before REV --after REV
        [--target cuda] [--precision fp16] [--jobs N]

REV is a git revision of this repository (exported with `git archive` into a temporary folder)
or `worktree` (this checkout as it is, uncommitted changes included). Each revision compiles
each model in a fresh process with an empty cache folder; the search's wall-clock safety cap is
lifted (POWERFUSION_SEARCH_BUDGET_S), so that only the code decides the plans, never the load.

Compared, per model: plan.json (timings left out), every kernel source byte for byte, and each
searched subgraph's decision from the plan cache (template label per op, predicted seconds,
the ranked top plans), matched by the subgraph's name. Printed: what differs, the wall and CPU
seconds of each compile, and a final line SAME or DIFFERENT; the exit status is 1 when anything
differs. Search statistics (plans considered, rewritten, pruned) are reported, not compared:
a faster search may evaluate fewer plans to reach the same decision.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_CAP = "1000000"   # seconds: the search's safety cap never cuts a search short


def checkout(rev: str, into: Path) -> Path:
    """The source tree of `rev` (or this checkout for 'worktree')."""
    if rev == "worktree":
        return ROOT
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "powerfusion"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def compile_with(tree: Path, model: Path, work: Path, args) -> dict:
    cache, out = work / "cache", work / "out"
    cmd = [sys.executable, "-m", "powerfusion.cli", "compile", str(model.resolve()), "--target", args.target,
           "-o", str(out), "-q", "--timings"]
    if args.precision != "fp32":
        cmd += ["--precision", args.precision]
    if args.jobs:
        cmd += ["-j", str(args.jobs)]
    env = {**os.environ, "PYTHONPATH": str(tree), "POWERFUSION_CACHE_DIR": str(cache),
           "POWERFUSION_SEARCH_BUDGET_S": NO_CAP}
    before = _children_cpu()
    t0 = time.perf_counter()
    # cwd: `python -m` puts the working folder ahead of PYTHONPATH, so run in the tree itself (from
    # another checkout's folder, that checkout's powerfusion would be the one compiled)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - before
    if r.returncode != 0:
        raise SystemExit(f"compile failed with {tree}:\n{r.stderr[-3000:]}")
    return {"out": out, "cache": cache, "wall_s": wall, "cpu_s": cpu, "timings": r.stdout.strip()}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _steps(timings: str) -> str:
    """The --timings lines (`  search  12.3 s`) as one short line."""
    parts = [line.split() for line in timings.splitlines() if line.startswith("  ")]
    return ", ".join(f"{p[0]} {p[1]}" for p in parts if len(p) >= 3 and p[0] in ("import", "search", "codegen"))


def decisions(cache: Path) -> dict[str, dict]:
    """Searched subgraph name -> what the plan cache holds for it."""
    out = {}
    for p in sorted((cache / "plans").glob("*.json")):
        payload = json.loads(p.read_text())["payload"]
        c = payload["choice"]
        out[payload["names"][3]] = {
            "labels": c.get("labels"), "predicted_s": c.get("predicted_s"), "note": c.get("note"),
            "top": [(t.get("labels"), t.get("predicted_s")) for t in c.get("top", [])],
            "stats": {k: c.get(k) for k in ("considered", "rewritten", "pruned", "infeasible")}}
    return out


def differences(a: dict, b: dict) -> list[str]:
    diffs = []
    plan_a, plan_b = (json.loads((r["out"] / "plan.json").read_text()) for r in (a, b))
    for plan in (plan_a, plan_b):
        plan.pop("timings_s", None)
    if plan_a != plan_b:
        diffs.append("plan.json differs")
    files_a = {p.name for p in a["out"].iterdir() if p.is_file()}
    files_b = {p.name for p in b["out"].iterdir() if p.is_file()}
    if files_a != files_b:
        diffs.append(f"files only before: {sorted(files_a - files_b)[:5]}; only after: {sorted(files_b - files_a)[:5]}")
    sources = sorted(n for n in files_a & files_b if not n.endswith((".json", ".npy")))
    changed = [n for n in sources if (a["out"] / n).read_bytes() != (b["out"] / n).read_bytes()]
    if changed:
        diffs.append(f"{len(changed)} of {len(sources)} kernel sources differ: {changed[:5]}")
    da, db = decisions(a["cache"]), decisions(b["cache"])
    if set(da) != set(db):
        diffs.append(f"searched subgraphs differ: only before {sorted(set(da) - set(db))[:5]}, "
                     f"only after {sorted(set(db) - set(da))[:5]}")
    for name in sorted(set(da) & set(db)):
        for field in ("labels", "predicted_s", "top", "note"):
            if da[name][field] != db[name][field]:
                diffs.append(f"{name}: {field} {da[name][field]!r:.200} -> {db[name][field]!r:.200}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--jobs", type=int, default=0, help="search workers (default: the compile's own)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pf-compare-"))
    same = True
    try:
        trees = {rev: checkout(rev, tmp / f"src-{k}") for k, rev in enumerate((args.before, args.after))}
        for model in args.models:
            runs = [compile_with(trees[rev], model, tmp / f"{model.stem}-{k}", args)
                    for k, rev in enumerate((args.before, args.after))]
            diffs = differences(*runs)
            stats = [sum(sum(v or 0 for v in d["stats"].values()) for d in decisions(r["cache"]).values())
                     for r in runs]
            print(f"{model.name}: before {runs[0]['wall_s']:.1f} s wall / {runs[0]['cpu_s']:.1f} s CPU, "
                  f"after {runs[1]['wall_s']:.1f} s / {runs[1]['cpu_s']:.1f} s CPU "
                  f"(search statistics summed: {stats[0]} -> {stats[1]}); "
                  f"{len(decisions(runs[1]['cache']))} searched subgraphs: "
                  + ("same" if not diffs else f"{len(diffs)} difference(s)"), flush=True)
            for k, r in enumerate(runs):
                print(f"    {('before', 'after')[k]} steps:", _steps(r["timings"]))
            for d in diffs[:20]:
                print("   ", d)
            same = same and not diffs
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print("kept", tmp)
    print("SAME" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
