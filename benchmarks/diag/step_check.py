"""Which step of a model's CUDA plan is wrong: every step (library call or kernel step) is fed
the reference values of its inputs and its outputs are compared with the reference, so an error
is pinned on the step that makes it instead of spreading downstream as in
`powerfusion compare --per-subgraph`.

    PYTHONPATH=$PWD python3 benchmarks/diag/step_check.py MODEL.onnx [--out DIR] [--inputs X.npz]

Reference: the CPU basic-op executor over the CUDA plan's own partition (numpy, float64
accumulation where the executor uses it). For a wrong kernel step it also runs the step's GIR
through the interpreter on the same inputs (is the GIR or its rendering wrong?) and writes the
step's kernel sources and basic ops to DIR.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

REL_TOL = 1e-4


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64).reshape(-1), np.asarray(want, np.float64).reshape(-1)
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def check_steps(sess, feeds: dict) -> tuple[list[dict], dict]:
    """One row per step (kind, name, the worst relative error of its outputs) and the reference
    values of every tensor."""
    import cupy
    from powerfusion.plan import KernelStep
    from powerfusion.session import execute_partition
    runner = sess._executor
    plan = runner.plan
    ref = execute_partition(plan.partition, feeds)
    rows = []
    for step in plan.steps:
        kernel = isinstance(step, KernelStep)
        ins, outs = (step.subgraph.inputs, step.subgraph.outputs) if kernel else (step.call.node.inputs,
                                                                                 step.call.node.outputs)
        for t in ins:
            if t in runner.tensors:
                host = np.ascontiguousarray(np.asarray(ref[t]).astype(plan.graph.tensors[t].dtype))
                runner.tensors[t][...] = cupy.asarray(host.view(np.uint16) if host.dtype.name == "bfloat16" else host)
        runner._run_steps([step])
        cupy.cuda.Device().synchronize()
        errs = {t: rel_err(cupy.asnumpy(runner.tensors[t]), ref[t]) for t in outs if t in runner.tensors}
        row = {"step": step.name, "kind": "kernels" if kernel else type(step.call.node.op).__name__,
               "worst": max(errs.values(), default=0.0), "errors": errs}
        if kernel and row["worst"] > REL_TOL:
            row["gir_interpreter_worst"] = _gir_error(step, ref)
        rows.append(row)
    return rows, ref


def _gir_error(step, ref) -> float:
    from powerfusion.gir.interpreter import np_dtype, run_gir
    g = step.gir
    feeds = {b: np.asarray(ref[step.buffers[b]]).reshape(-1).astype(np_dtype(g.buffer(b).dtype)) for b in g.inputs}
    got = run_gir(g, feeds)
    return max((rel_err(got[b], ref[step.buffers[b]]) for b in g.outputs), default=0.0)


def describe(sess, name: str) -> str:
    """The step's basic ops and its kernels' sources."""
    step = next(s for s in sess._executor.plan.steps if s.name == name)
    g = sess.graph
    lines = [f"step {name}"]
    if hasattr(step, "subgraph"):
        for n in step.subgraph.nodes:
            shapes = [tuple(g.tensors[t].shape) for t in n.inputs]
            lines.append(f"  {n.name}: {n.op!r} {shapes} -> {[tuple(g.tensors[t].shape) for t in n.outputs]}")
        for k in step.kernels:
            lines += ["", f"// ---- {k.name} grid {k.grid} block {k.block}", k.source]
    else:
        n = step.call.node
        lines.append(f"  {n.op!r} {[tuple(g.tensors[t].shape) for t in n.inputs]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from powerfusion import InferenceSession
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--inputs", help=".npz of the model's inputs (default: seeded standard normal)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sess = InferenceSession(args.model, target="cuda")
    if args.inputs:
        feeds = dict(np.load(args.inputs))
    else:
        rng = np.random.default_rng(0)
        feeds = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in sess.graph.inputs}
    rows, ref = check_steps(sess, feeds)
    whole = sess.run(None, feeds)
    rows.append({"step": "whole run", "kind": "model", "errors": {},
                 "worst": max(rel_err(w, ref[t.name]) for w, t in zip(whole, sess.graph.outputs))})
    bad = [r for r in rows if r["worst"] > REL_TOL]
    for r in rows:
        flag = "WRONG" if r in bad else "ok"
        extra = f"  (GIR interpreter: {r['gir_interpreter_worst']:.1e})" if "gir_interpreter_worst" in r else ""
        print(f"{r['step']:>12s} {r['kind']:>10s} {r['worst']:9.1e} {flag}{extra}", flush=True)
    print(f"{len(bad)} of {len(rows)} steps wrong (relative error > {REL_TOL:g})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_check.json").write_text(json.dumps(rows, indent=1))
        steps = [r for r in bad if r["kind"] != "model"]
        if steps:
            (out / "wrong_steps.txt").write_text("\n\n".join(describe(sess, r["step"]) for r in steps[:4]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
