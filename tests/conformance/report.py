"""Counts of the ONNX node conformance run: python3 tests/conformance/report.py [--list] [--write]

Prints passed / supported / total, the declined cases (unsupported op, unsupported opset),
excluded cases (filters.py) and bugs (wrong numbers or errors among supported ops; must be 0).
Exit status 1 when there is any bug outside filters.py. --write records the run in
benchmarks/results/conformance.{json,md} (one current file; earlier runs are in git history).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from filters import excluded_reason  # noqa: E402
from node_cases import all_cases, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list every case that did not pass, with the reason")
    parser.add_argument("-k", help="only cases whose name contains this text")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/conformance.json and .md (the whole suite only)")
    args = parser.parse_args()
    cases = {n: c for n, c in sorted(all_cases().items()) if not args.k or args.k in n}
    start = time.perf_counter()
    outcomes, excluded = [], {}
    for name, case in cases.items():
        outcome = run_case(case)
        outcomes.append(outcome)
        reason = excluded_reason(name, case.model)
        if reason:
            excluded[name] = reason
    seconds = time.perf_counter() - start
    by = collections.Counter(o.status for o in outcomes)
    supported = sum(o.status not in ("unsupported", "opset") for o in outcomes)
    bound = sum(bool(o.bound) for o in outcomes if o.status == "passed")
    bugs = [o for o in outcomes if o.bug and o.name not in excluded]
    wrong = [o for o in bugs if o.status == "wrong"]
    print(f"ONNX node conformance on the CPU: {len(outcomes)} cases in {seconds:.0f} s")
    print(f"  passed / supported / total: {by['passed']} / {supported} / {len(outcomes)}"
          f"  ({bound} passed with shape-like inputs bound at compile time)")
    print(f"  declined: {by['unsupported']} unsupported op, {by['opset']} unsupported opset")
    print(f"  excluded in filters.py: {len(excluded)}")
    print(f"  wrong numbers among supported ops (outside filters.py): {len(wrong)}")
    print(f"  errors among supported ops (outside filters.py): {len(bugs) - len(wrong)}")
    if args.list:
        for o in outcomes:
            if o.status != "passed":
                tag = " [excluded]" if o.name in excluded else ""
                print(f"{o.status:<12}{o.name}{tag}: {o.detail}")
    else:
        for o in bugs:
            print(f"{o.status:<8}{o.name}: {o.detail}")
    if args.write and not args.k:
        write_results(outcomes, excluded, seconds)
    return 1 if bugs else 0


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "results")
# the same harness before the op-coverage work (onnx 1.23.2, commit 96028a3)
BEFORE = {"commit": "96028a3", "passed": 798, "wrong": 0, "errors": 0, "unsupported": 761, "opset": 301}


def write_results(outcomes, excluded: dict, seconds: float) -> None:
    import onnx
    by = collections.Counter(o.status for o in outcomes)
    declined_ops = collections.Counter()
    for o in outcomes:
        if o.status == "unsupported":
            declined_ops.update(set(re.findall(r"\((\w+), opset", o.detail)))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_commit": _commit(), "device": "2-core CPU, PowerFusion cpu target", "onnx": onnx.__version__,
            "seconds": round(seconds, 1)}
    bugs = [o for o in outcomes if o.bug and o.name not in excluded]
    summary = {"total": len(outcomes), "passed": by["passed"], "unsupported": by["unsupported"],
               "opset": by["opset"], "wrong": sum(o.status == "wrong" for o in bugs),
               "errors": sum(o.status == "error" for o in bugs), "excluded": len(excluded)}
    doc = {"meta": meta, "before": BEFORE, "summary": summary,
           "declined_by_op": dict(declined_ops.most_common()),
           "cases": {o.name: o.status + (" (excluded)" if o.name in excluded else "") for o in outcomes}}
    with open(os.path.join(RESULTS, "conformance.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    top = ", ".join(f"{op} {n}" for op, n in declined_ops.most_common(15))
    lines = ["# ONNX node conformance (CPU)", "",
             f"{meta['device']}, {meta['date']}, commit {meta['git_commit']}, onnx {meta['onnx']}; "
             f"cases from `onnx.backend.test.case.node.collect_testcases`, run by `tests/conformance/report.py`.", "",
             "| run | passed | unsupported op | unsupported opset | excluded (filters.py) | wrong | errors |",
             "|---|---:|---:|---:|---:|---:|---:|",
             f"| before ({BEFORE['commit']}) | {BEFORE['passed']} | {BEFORE['unsupported']} | {BEFORE['opset']} | "
             f"32 | 0 | 0 |",
             f"| now ({meta['git_commit']}) | {summary['passed']} | {summary['unsupported']} | {summary['opset']} | "
             f"{summary['excluded']} | {summary['wrong']} | {summary['errors']} |", "",
             f"Of {summary['total']} cases. Op types most often named by declined cases: {top}.", ""]
    with open(os.path.join(RESULTS, "conformance.md"), "w") as f:
        f.write("\n".join(lines))


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
