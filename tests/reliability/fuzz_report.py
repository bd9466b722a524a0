"""Run the fuzzer's long profiles (test_fuzz_session.py, PF_FUZZ_SLOW=1) and record what they
checked in benchmarks/results/reliability-fuzz.{json,md}: per profile the examples hypothesis
ran (passing / failing / invalid), the wall time and the outcome; for the compile profiles (nvcc,
hipcc) the examples drawn, the kernels emitted, the distinct ones compiled and the compiler runs.

    python -m tests.reliability.fuzz_report [--examples 5000] [--profiles session interpreter nvcc hipcc]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SELECT = {"session": "onnxruntime_long and not interpreter", "interpreter": "onnxruntime_long and interpreter",
          "nvcc": "nvcc_long", "hipcc": "hipcc_long"}
COMPILE = ("nvcc", "hipcc")
# What the long runs found on the way (kept with the table, which each run rewrites)
FINDINGS = """Findings so far. Before the magnitude-relative tolerance the interpreter profile stopped at
1720 examples (a cancelling sum). On the way to 5000 it found Reciprocal(Relu(-0.0)) (+inf where
onnxruntime gives -inf: Relu now passes -0.0 through) and ReduceMean of an empty set (ONNX:
undefined; ours NaN, onnxruntime 0: NaN-open since). The nvcc profile compiled one kernel per
nvcc run (500 examples in 193 s) until kernels were batched; batched, nvcc and hipcc found
nothing in 5000 examples each."""   # -k matches the module name too: "session" alone would select every profile
_COUNTS = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


def run_profile(profile: str, examples: int, commit: str) -> dict:
    fd, name = tempfile.mkstemp(prefix=f"pf-fuzz-{profile}-", suffix=".json")
    os.close(fd)
    stats_file = Path(name)
    stats_file.unlink()
    env = {**os.environ, "PF_FUZZ_SLOW": "1", "PF_FUZZ_EXAMPLES": str(examples), "PF_FUZZ_STATS": str(stats_file)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "slow", "-p", "no:cacheprovider",
           "--hypothesis-show-statistics", "tests/reliability/test_fuzz_session.py", "-k", SELECT[profile]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    failure = re.search(r"^E\s+(.*Error.*)$", out, re.M)
    row = {"profile": profile, "planned": examples, "seconds": round(seconds, 1), "commit": commit,
           "date": _now(),
           "outcome": "passed" if proc.returncode == 0 else "failed",
           "first_failure": failure[1][:300] if failure and proc.returncode else None}
    if profile in COMPILE:   # hypothesis runs inside the test there: it writes its own counts
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
        stats_file.unlink(missing_ok=True)
        if proc.returncode and not row["first_failure"]:
            row["first_failure"] = out.strip().splitlines()[-1][:300] if out.strip() else None
        return {**row, "passing": stats.get("examples", 0) if not stats.get("failures") else 0,
                "failing": stats.get("failures", 0), "invalid": None, **{k: stats.get(k) for k in
                ("with_kernels", "kernels", "distinct", "units", "generate_s", "compile_s")}}
    phases = [tuple(map(int, m)) for m in _COUNTS.findall(out)]
    generated = phases[0] if phases else (0, 0, 0)
    return {**row, "passing": generated[0], "failing": generated[1], "invalid": generated[2]}


def _commit() -> str:
    """HEAD, or PF_FUZZ_COMMIT where the tree is an exported copy (no git)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return os.environ.get("PF_FUZZ_COMMIT") or head.stdout.strip() or "unknown"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merged(rows: list[dict]) -> list[dict]:
    """`rows` and, for the profiles not in them, the rows of the current results (each row
    carries the commit and date it ran at)."""
    path = RESULTS / "reliability-fuzz.json"
    old = json.loads(path.read_text()) if path.exists() else {"profiles": []}
    ran = {r["profile"] for r in rows}
    kept = [{"commit": old.get("commit"), "date": old.get("date"), **r} for r in old["profiles"]
            if r["profile"] not in ran]
    order = list(SELECT)
    return sorted(kept + rows, key=lambda r: order.index(r["profile"]))


def write(rows: list[dict], commit: str) -> None:
    meta = {"date": _now(), "commit": commit,
            "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)", "profiles": rows}
    (RESULTS / "reliability-fuzz.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Reliability fuzzer (long profiles)", "",
             f"{meta['machine']}, {meta['date']}, commit {meta['commit']}; `python -m tests.reliability.fuzz_report`. "
             "Random ONNX graphs (tests/reliability/fuzz_graphs.py) against onnxruntime; counts are hypothesis' "
             "generate phase (invalid: drawn cases the strategy rejected). Tolerance of a finite element: "
             "|ours - onnxruntime| <= 1e-5 + 1e-4 |onnxruntime| + 1e-5 m, m = the output evaluated on the magnitudes "
             "of the summed terms (test_fuzz_session.magnitude_model).", "",
             "| profile | planned | passing | failing | invalid | seconds | outcome | commit, date |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        invalid = "" if r["invalid"] is None else r["invalid"]
        lines.append(f"| {r['profile']} | {r['planned']} | {r['passing']} | {r['failing']} | {invalid} | "
                     f"{r['seconds']} | {r['outcome']} | {r.get('commit')}, {r.get('date')} |")
    compiled = [r for r in rows if r["profile"] in COMPILE]
    if compiled:
        lines += ["", "Compile profiles (nvcc -cubin sm_90, hipcc --genco gfx90a): every kernel the drawn graphs "
                  "emit, identical sources once, ~200 per translation unit, two compiler runs at a time "
                  "(tests/reliability/batch_compile.py); passing = examples drawn, failing = kernels rejected.", "",
                  "| profile | examples with kernels | kernels | distinct | compiler runs | generate s | compile s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['profile']} | {r['with_kernels']} | {r['kernels']} | {r['distinct']} | {r['units']} | "
                  f"{r['generate_s']} | {r['compile_s']} |" for r in compiled]
    for r in rows:
        if r["first_failure"]:
            lines += ["", f"{r['profile']}: first failure: `{r['first_failure']}`"]
    (RESULTS / "reliability-fuzz.md").write_text("\n".join(lines + ["", FINDINGS]) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--profiles", nargs="+", default=["session", "interpreter", "nvcc", "hipcc"], choices=sorted(SELECT))
    ap.add_argument("--merge", action="store_true", help="keep the current rows of the profiles not run")
    args = ap.parse_args(argv)
    commit = _commit()   # the code that is fuzzed, whatever is committed while it runs
    rows = [run_profile(p, args.examples, commit) for p in args.profiles]
    write(merged(rows) if args.merge else rows, commit)
    print((RESULTS / "reliability-fuzz.md").read_text())
    return 0 if all(r["outcome"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
