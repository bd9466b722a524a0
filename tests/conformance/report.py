"""Counts of the ONNX node conformance run: python3 tests/conformance/report.py [--list]

Prints passed / supported / total, the declined cases (unsupported op, unsupported opset),
excluded cases (filters.py) and bugs (wrong numbers or errors among supported ops; must be 0).
Exit status 1 when there is any bug outside filters.py.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from filters import excluded_reason  # noqa: E402
from node_cases import all_cases, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list every case that did not pass, with the reason")
    parser.add_argument("-k", help="only cases whose name contains this text")
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
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
