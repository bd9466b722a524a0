"""Run the fuzzer's long profiles (test_fuzz_session.py, PF_FUZZ_SLOW=1) and record what they
checked in benchmarks/results/reliability-fuzz.{json,md}: per profile the examples hypothesis
ran (passing / failing / invalid), the wall time and the outcome.

    python -m tests.reliability.fuzz_report [--examples 5000] [--profiles session interpreter nvcc]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SELECT = {"session": "onnxruntime_long and not interpreter", "interpreter": "onnxruntime_long and interpreter",
          "nvcc": "nvcc_long"}   # -k matches the module name too: "session" alone would select every profile
_COUNTS = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


def run_profile(profile: str, examples: int) -> dict:
    env = {**os.environ, "PF_FUZZ_SLOW": "1", "PF_FUZZ_EXAMPLES": str(examples)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "slow", "-p", "no:cacheprovider",
           "--hypothesis-show-statistics", "tests/reliability/test_fuzz_session.py", "-k", SELECT[profile]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    phases = [tuple(map(int, m)) for m in _COUNTS.findall(out)]
    generated = phases[0] if phases else (0, 0, 0)
    failure = re.search(r"^E\s+(.*Error.*)$", out, re.M)
    return {"profile": profile, "planned": examples // 10 if profile == "nvcc" else examples,
            "passing": generated[0], "failing": generated[1], "invalid": generated[2],
            "seconds": round(seconds, 1), "outcome": "passed" if proc.returncode == 0 else "failed",
            "first_failure": failure[1][:300] if failure and proc.returncode else None}


def _commit() -> str:
    """HEAD, or PF_FUZZ_COMMIT where the tree is an exported copy (no git)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return os.environ.get("PF_FUZZ_COMMIT") or head.stdout.strip() or "unknown"


def write(rows: list[dict], commit: str) -> None:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit,
            "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)", "profiles": rows}
    (RESULTS / "reliability-fuzz.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Reliability fuzzer (long profiles)", "",
             f"{meta['machine']}, {meta['date']}, commit {meta['commit']}; `python -m tests.reliability.fuzz_report`. "
             "Random ONNX graphs (tests/reliability/fuzz_graphs.py) against onnxruntime; counts are hypothesis' "
             "generate phase (invalid: drawn cases the strategy rejected). Tolerance of a finite element: "
             "|ours - onnxruntime| <= 1e-5 + 1e-4 |onnxruntime| + 1e-5 m, m = the output evaluated on the magnitudes "
             "of the summed terms (test_fuzz_session.magnitude_model).", "",
             "| profile | planned | passing | failing | invalid | seconds | outcome |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['planned']} | {r['passing']} | {r['failing']} | {r['invalid']} | "
                     f"{r['seconds']} | {r['outcome']} |")
    for r in rows:
        if r["first_failure"]:
            lines += ["", f"{r['profile']}: first failure: `{r['first_failure']}`"]
    (RESULTS / "reliability-fuzz.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--profiles", nargs="+", default=["session", "interpreter", "nvcc"], choices=sorted(SELECT))
    args = ap.parse_args(argv)
    commit = _commit()   # the code that is fuzzed, whatever is committed while it runs
    rows = [run_profile(p, args.examples) for p in args.profiles]
    write(rows, commit)
    print((RESULTS / "reliability-fuzz.md").read_text())
    return 0 if all(r["outcome"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
