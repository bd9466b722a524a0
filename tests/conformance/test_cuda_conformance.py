"""ONNX node conformance cases on CUDA: each case runs through the plan runner of the CUDA
session (CudaPlanRunner), with the selection, input binding and exclusions of the CPU run
(node_cases.py, filters.py). Cases the frontend declines (unsupported op or opset) are skipped
with that reason; the CPU run already checks how they are declined.

Poisoning: each plan runs twice, its whole buffer arena (inputs, intermediates, outputs) and its
kernels' scratch buffers filled first with 0xFF bytes (NaN in every float type, -1 in integers),
then with 0x7B bytes (a large finite float, a large integer). An element no kernel wrote cannot
match the expected value in both runs.

Tolerances, against the case's expected outputs (numpy / onnx reference implementation): the
wider of the case's own rtol/atol and this floor per output dtype (CUDA's math functions are
within a few ulp of libm's, and kernels reduce in another order than numpy):
    float64   rtol 1e-7  atol 1e-12
    float32   rtol 1e-4  atol 1e-6
    float16   rtol 1e-2  atol 1e-3
    bfloat16  rtol 2e-2  atol 1e-2
    integers and bool: exact.   NaN matches NaN.

Plans: compiling every case takes CPU minutes and needs no GPU, so
`benchmarks/precompile_conformance.py` compiles them beforehand into a folder (PF_CUDA_PLANS,
default out/conformance-plans). A plan from there is used only when the folder was written from
the same compiler sources (a hash of powerfusion/ without the CUDA runtime files); otherwise,
or for a case missing there, the test compiles (and says so in the summary).

Summary: with PF_CUDA_CONFORMANCE_REPORT=<path.json>, every case appends one JSON line to
<path.json>.lines and each test process, when done, rewrites <path.json>: counts per status, pass
and fail counts per op type, and every failure with its detail (works under pytest-xdist).
"""
from __future__ import annotations

import collections
import fcntl
import gzip
import hashlib
import json
import os
import pickle
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from filters import excluded_reason
from node_cases import (DECLINED, Outcome, _array, _one_line, all_cases, bind_inputs, case_op_types, case_opset,
                        compare_outputs)
from node_cases import _attempt as _attempt_cpu

ROOT = Path(__file__).resolve().parents[2]
PLANS_DIR = Path(os.environ.get("PF_CUDA_PLANS") or ROOT / "out" / "conformance-plans")
REPORT = os.environ.get("PF_CUDA_CONFORMANCE_REPORT")
POISONS = (0xFF, 0x7B)
# dtype name -> (rtol, atol) floors; integer and bool outputs compare exactly
TOLERANCE = {"float64": (1e-7, 1e-12), "float32": (1e-4, 1e-6), "float16": (1e-2, 1e-3),
             "bfloat16": (2e-2, 1e-2)}
# files that run plans but do not shape them: editing them keeps precompiled plans valid
_RUNTIME_ONLY = {"backends/cuda/session.py", "backends/cuda/executor.py", "backends/cuda/runtime.py",
                 "backends/cuda/library.py"}
_NOT_COMPILER = ("viz/", "cli/")


# ---- compiling (here or beforehand) ---------------------------------------------------

def source_hash() -> str:
    """Hash of the compiler's sources: plans written under another hash are not used."""
    pkg = ROOT / "powerfusion"
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*.py")):
        rel = p.relative_to(pkg).as_posix()
        if rel in _RUNTIME_ONLY or rel.startswith(_NOT_COMPILER):
            continue
        h.update(rel.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def classify(name: str, model, e: Exception) -> tuple[str, str]:
    """(status, detail) of a failed compile, by the rules of node_cases._attempt."""
    from powerfusion.errors import ModelError, UnsupportedOpError
    if isinstance(e, UnsupportedOpError):
        from powerfusion.frontend.loader import MIN_OPSET
        ops = {op for _, op, _, _ in e.nodes}
        if not ops & case_op_types(model) and case_opset(model) >= MIN_OPSET:
            return "error", f"UnsupportedOpError names {sorted(ops)}, not an op of the case: {_one_line(e)}"
        return "unsupported", _one_line(e)
    if isinstance(e, ModelError):
        from powerfusion.frontend.loader import MAX_OPSET, MIN_UPGRADABLE_OPSET
        if not MIN_UPGRADABLE_OPSET <= case_opset(model) <= MAX_OPSET and "opset" in str(e):
            return "opset", _one_line(e)
        return "error", f"ModelError: {_one_line(e)}"
    return "error", _where(e)


def compile_classified(name: str, model):
    """(plan or None, status, detail): status is 'compiled' or a classify() status."""
    from powerfusion.compiler import compile_model
    try:
        return slim(compile_model(model, "cuda")), "compiled", ""
    except Exception as e:
        return (None, *classify(name, model, e))


def slim(plan):
    """Drop what only inspection needs (pre-rewrite graph, rewrite trace): smaller pickles."""
    for s in plan.kernel_steps:
        s.merged, s.trace = None, []
    return plan


def variants(case):
    """(key, model, feeds, expected, bound) per data set: the case as given, then bound."""
    for k, (inputs, expected) in enumerate(case.data_sets):
        inputs = [_array(x) for x in inputs]
        expected = [_array(x) for x in expected]
        model, feeds, bound = bind_inputs(case.model, inputs)
        yield k, inputs, expected, (f"bound{k}", model, feeds, bound)


class PlanStore:
    """Precompiled plans (see benchmarks/precompile_conformance.py), else compile now."""

    def __init__(self, folder: Path):
        self.folder, self.entries, self.note = folder, {}, ""
        manifest = folder / "manifest.json"
        if not manifest.exists():
            self.note = f"no precompiled plans in {folder.name}/: compiling"
            return
        doc = json.loads(manifest.read_text())
        if doc.get("source_hash") != source_hash():
            self.note = f"plans in {folder.name}/ are from other compiler sources: compiling"
            return
        self.entries = doc["entries"]

    def load(self, key: str):
        """The precompiled plan under `key`, or None (absent, declined, or unreadable)."""
        entry = self.entries.get(key)
        if entry is None or entry["status"] != "compiled":
            return None
        try:
            return pickle.loads(gzip.decompress((self.folder / entry["file"]).read_bytes()))
        except Exception:  # unreadable (class layout changed): the caller compiles
            return None

    def get(self, name: str, variant: str, model):
        """(plan or None, status, detail, source) with source 'precompiled' or 'compiled here'."""
        entry = self.entries.get(f"{name}/{variant}")
        if entry is not None and entry["status"] != "compiled":
            return None, entry["status"], entry["detail"], "precompiled"
        plan = self.load(f"{name}/{variant}")
        if plan is not None:
            return plan, "compiled", "", "precompiled"
        return (*compile_classified(name, model), "compiled here")


# ---- running on the device ------------------------------------------------------------

def poison(runner, byte: int) -> None:
    runner.arena.fill(byte)
    for ex in runner.executors.values():
        for b, arr in ex.scratch.items():
            if b not in dict(ex.graph.constants):
                arr.view(np.uint8).fill(byte)


def run_plan(plan, model, feeds: list) -> list[list]:
    """Outputs of each poisoned run, in the model's output order."""
    from powerfusion.backends.cuda.session import CudaPlanRunner
    initialized = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initialized]
    runner = CudaPlanRunner(plan)
    runs = []
    for byte in POISONS:
        poison(runner, byte)
        got = runner(dict(zip(names, feeds)))
        runs.append([got[t.name] for t in plan.graph.outputs])
    return runs


def attempt(store: PlanStore, case, variant: str, model, feeds, expected, bound) -> tuple[Outcome, str]:
    plan, status, detail, source = store.get(case.name, variant, model)
    if plan is None:
        return Outcome(case.name, status, detail, bound), source
    try:
        runs = run_plan(plan, model, feeds)
    except Exception as e:
        return Outcome(case.name, "error", "on the device: " + _where(e), bound), source
    for byte, got in zip(POISONS, runs):
        problem = compare_outputs(got, expected, case.rtol, case.atol, TOLERANCE)
        if problem:
            return Outcome(case.name, "wrong", f"{problem} (poison 0x{byte:02X})", bound), source
    return Outcome(case.name, "passed", "", bound), source


def run_cuda_case(case, store: PlanStore) -> tuple[Outcome, str]:
    """As node_cases.run_case: each data set as given, retried with shape-like inputs bound.
    Unlike the CPU run, a bound retry that fails with an error where the CPU run passes the same
    bound case is reported (not the decline of the case as given): a bug of the CUDA pipeline."""
    first = None
    for k, inputs, expected, (variant, bmodel, bfeeds, bound) in variants(case):
        outcome, source = attempt(store, case, "given", case.model, inputs, expected, ())
        if (outcome.status in DECLINED or outcome.status == "error") and bound:
            retry, rsource = attempt(store, case, variant, bmodel, bfeeds, expected, bound)
            if retry.status in ("passed", "wrong") or (outcome.status == "error" and retry.status in DECLINED):
                outcome, source = retry, rsource
            elif retry.status == "error" and outcome.status in DECLINED and \
                    _attempt_cpu(case, bmodel, bfeeds, expected, bound).status == "passed":
                outcome, source = Outcome(case.name, "error", "passes on the CPU with inputs bound; "
                                          + retry.detail, bound), rsource
        if outcome.status != "passed":
            return outcome, source
        first = first or (outcome, source)
    return first or (Outcome(case.name, "error", "case has no data sets"), "")


def _where(e: Exception) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return f"{type(e).__name__}: {_one_line(e)}{at}"


# ---- the summary file -----------------------------------------------------------------

def record(outcome: Outcome, case, source: str, seconds: float, excluded: str | None) -> None:
    if not REPORT:
        return
    line = {"case": outcome.name, "status": outcome.status, "ops": sorted(case_op_types(case.model)),
            "bound": list(outcome.bound), "plan": source, "seconds": round(seconds, 3),
            "excluded": excluded, "detail": outcome.detail[:600]}
    with open(REPORT + ".lines", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(line) + "\n")


def write_summary(note: str, report: str | None = None) -> None:
    report = report or REPORT
    lines = Path(report + ".lines")
    if not lines.exists():
        return
    with open(lines) as f:  # the lock keeps writers in order: the last one has read every line
        fcntl.flock(f, fcntl.LOCK_EX)
        rows = {r["case"]: r for r in map(json.loads, f.read().splitlines())}.values()
        _write_summary(rows, note, report)


def _write_summary(rows, note: str, report: str) -> None:
    per_op = collections.defaultdict(collections.Counter)
    for r in rows:
        for op in r["ops"]:
            per_op[op][r["status"]] += 1
    doc = {"cases": len(rows), "status": dict(collections.Counter(r["status"] for r in rows)),
           "bugs_outside_filters": sum(r["status"] in ("wrong", "error") and not r["excluded"] for r in rows),
           "plans": dict(collections.Counter(r["plan"] for r in rows)), "plan_store": note,
           "device_seconds": round(sum(r["seconds"] for r in rows), 1),
           "per_op": {op: dict(c) for op, c in sorted(per_op.items())},
           "failures": sorted(({k: r[k] for k in ("case", "status", "detail", "excluded", "bound")}
                               for r in rows if r["status"] in ("wrong", "error")), key=lambda r: r["case"])}
    tmp = Path(f"{report}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(report)


@pytest.fixture(scope="module")
def store():
    s = PlanStore(PLANS_DIR)
    yield s
    if REPORT:
        write_summary(s.note or f"precompiled plans from {PLANS_DIR.name}/")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(all_cases()))
def test_cuda_node_case(name, store):
    case = all_cases()[name]
    t0 = time.perf_counter()
    outcome, source = run_cuda_case(case, store)
    reason = excluded_reason(name, case.model, "cuda")
    record(outcome, case, source, time.perf_counter() - t0, reason)
    if reason:
        assert outcome.bug or outcome.status in DECLINED, \
            f"{name} is excluded in filters.py ({reason}) but now {outcome.status} on CUDA: remove the entry"
        pytest.xfail(f"excluded: {reason} [{outcome.status}: {outcome.detail[:200]}]")
    if outcome.status in DECLINED:
        pytest.skip(f"declined by the frontend ({outcome.status}): {outcome.detail[:200]}")
    assert not outcome.bug, f"{name}: {outcome.status}: {outcome.detail}"


if __name__ == "__main__":  # python3 tests/conformance/test_cuda_conformance.py REPORT.json: summary again
    import sys
    write_summary("rewritten from the lines file", sys.argv[1])
    print(Path(sys.argv[1]).read_text()[:400])
