"""Accuracy of the perf model: predicted vs measured time of many plans of the benchmark subgraphs.

    python3 benchmarks/perfmodel_accuracy.py compile-time model.onnx CACHE_DIR [JOBS [BEAM]]  # search time

Two steps, because lowering and rewriting every plan is CPU work and GPU time is scarce:

    python3 benchmarks/perfmodel_accuracy.py prepare out/perfmodel_plans.pkl [CASES [LIMIT]]  # any machine
    python3 benchmarks/perfmodel_accuracy.py run out/perfmodel_plans.pkl $OUT [calibration.json]  # on the GPU
    python3 benchmarks/perfmodel_accuracy.py prepare-model model.onnx out/plans.pkl [LIMIT]  # a model's subgraphs

`prepare` builds the benchmark subgraphs (LayerNorm / RMSNorm / softmax at several N,
elementwise chains, transposes, ShuffleNet's channel shuffle, GPT-2-style decode
attention), enumerates every plan (`lower.enumerate_plans`), rewrites each with the
greedy optimiser and keeps those the verifier and the CUDA renderer accept. `run`
applies the calibration found next to it (benchmarks/results/calibration-*.json, or the
one just measured), predicts every plan, times every plan on the device (CUDA-graph
replay, powerfusion.pipeline.tune), and reports per case and overall:
Spearman rank correlation of predicted vs measured time, and how far the model's pick
(and the best of its top-8) is from the best measured plan. JSON + markdown under $OUT.
"""
from __future__ import annotations

import json
import math
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ---- benchmark subgraphs (ONNX, built with onnx.helper) -----------------------------------

def _model(nodes, inputs, outputs, inits=()):
    from onnx import TensorProto as T, helper as h
    g = h.make_graph(nodes, "case", [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs],
                     [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in outputs], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18)])


def _const(name, value):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.asarray(value), name)


def layernorm(R, N):
    from onnx import helper as h
    return _model([h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)],
                  [("x", [R, N])], [("y", [R, N])],
                  [_const("g", np.ones(N, np.float32)), _const("b", np.zeros(N, np.float32))])


def rmsnorm(R, N):
    from onnx import helper as h
    nodes = [h.make_node("Mul", ["x", "x"], ["sq"]), h.make_node("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1),
             h.make_node("Add", ["ms", "eps"], ["mse"]), h.make_node("Sqrt", ["mse"], ["rms"]),
             h.make_node("Div", ["x", "rms"], ["xn"]), h.make_node("Mul", ["xn", "g"], ["y"])]
    return _model(nodes, [("x", [R, N])], [("y", [R, N])],
                  [_const("ax", np.array([-1], np.int64)), _const("eps", np.float32(1e-6)),
                   _const("g", np.ones(N, np.float32))])


def softmax(R, N):
    from onnx import helper as h
    return _model([h.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", [R, N])], [("y", [R, N])])


def gelu_chain(n):
    from onnx import helper as h
    nodes = [h.make_node("Add", ["x", "bias"], ["xb"]), h.make_node("Div", ["xb", "s2"], ["xs"]),
             h.make_node("Erf", ["xs"], ["e"]), h.make_node("Add", ["e", "one"], ["e1"]),
             h.make_node("Mul", ["xb", "e1"], ["m"]), h.make_node("Mul", ["m", "half"], ["y"])]
    return _model(nodes, [("x", [n // 1024, 1024])], [("y", [n // 1024, 1024])],
                  [_const("bias", np.zeros(1024, np.float32)), _const("s2", np.float32(1.4142135)),
                   _const("one", np.float32(1.0)), _const("half", np.float32(0.5))])


def add_relu_mul(n):
    from onnx import helper as h
    nodes = [h.make_node("Add", ["a", "b"], ["s"]), h.make_node("Relu", ["s"], ["r"]),
             h.make_node("Mul", ["r", "a"], ["y"])]
    return _model(nodes, [("a", [n]), ("b", [n])], [("y", [n])])


def transpose2d(R, C):
    from onnx import helper as h
    return _model([h.make_node("Transpose", ["x"], ["y"], perm=[1, 0])], [("x", [R, C])], [("y", [C, R])])


def transpose3d(A, B, C):
    from onnx import helper as h
    return _model([h.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 1])], [("x", [A, B, C])], [("y", [A, C, B])])


def channel_shuffle(C, H, W, N=1):
    """ShuffleNetV2's concat -> reshape -> transpose -> reshape -> split (the paper's Figure 3)."""
    from onnx import helper as h
    nodes = [h.make_node("Concat", ["a", "b"], ["c"], axis=1),
             h.make_node("Reshape", ["c", "s1"], ["r1"]),
             h.make_node("Transpose", ["r1"], ["t"], perm=[0, 2, 1, 3, 4]),
             h.make_node("Reshape", ["t", "s2"], ["r2"]),
             h.make_node("Split", ["r2", "sp"], ["y1", "y2"], axis=1)]
    return _model(nodes, [("a", [N, C, H, W]), ("b", [N, C, H, W])], [("y1", [N, C, H, W]), ("y2", [N, C, H, W])],
                  [_const("s1", np.array([N, 2, C, H, W], np.int64)), _const("s2", np.array([N, 2 * C, H, W], np.int64)),
                   _const("sp", np.array([C, C], np.int64))])


def decode_attention(H, T, D):
    """One decode step of attention with a KV cache: softmax(q K^T / sqrt(D)) V (two GEMVs)."""
    from onnx import helper as h
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             h.make_node("MatMul", ["q", "kt"], ["s"]), h.make_node("Mul", ["s", "scale"], ["ss"]),
             h.make_node("Softmax", ["ss"], ["p"], axis=-1), h.make_node("MatMul", ["p", "v"], ["y"])]
    return _model(nodes, [("q", [1, H, 1, D]), ("k", [1, H, T, D]), ("v", [1, H, T, D])], [("y", [1, H, 1, D])],
                  [_const("scale", np.float32(1 / math.sqrt(D)))])


HELD_OUT = ("layernorm_256x1024", "softmax_128x512", "transpose_256x1024", "rmsnorm_64x2048", "add_relu_mul_2M",
            "channel_shuffle_58x56x56")

CASES = {  # small sizes keep lowering and rewriting every plan affordable on a small CPU
    "layernorm_128x768": lambda: layernorm(128, 768),
    "layernorm_16x4096": lambda: layernorm(16, 4096),
    "layernorm_512x128": lambda: layernorm(512, 128),
    "rmsnorm_128x1024": lambda: rmsnorm(128, 1024),
    "softmax_256x128": lambda: softmax(256, 128),
    "softmax_32x2048": lambda: softmax(32, 2048),
    "gelu_131072": lambda: gelu_chain(131072),
    "add_relu_mul_512K": lambda: add_relu_mul(1 << 19),
    "transpose_512x512": lambda: transpose2d(512, 512),
    "transpose_8x128x256": lambda: transpose3d(8, 128, 256),
    "channel_shuffle_116x28x28": lambda: channel_shuffle(116, 28, 28),
    "decode_attention_12x256x64": lambda: decode_attention(12, 256, 64),
    # held out: not looked at while the model's constants were set
    "layernorm_256x1024": lambda: layernorm(256, 1024),
    "softmax_128x512": lambda: softmax(128, 512),
    "transpose_256x1024": lambda: transpose2d(256, 1024),
    "rmsnorm_64x2048": lambda: rmsnorm(64, 2048),
    "add_relu_mul_2M": lambda: add_relu_mul(1 << 21),
    "channel_shuffle_58x56x56": lambda: channel_shuffle(58, 56, 56),
    # benchmark sizes (gir_cases.py): long rows that stream, few long rows, GEMVs over a KV cache
    "big_rmsnorm_8192x16384": lambda: rmsnorm(8192, 16384),
    "big_layernorm_4096x65536": lambda: layernorm(4096, 65536),
    "big_softmax_32768x1024": lambda: softmax(32768, 1024),
    "big_gelu_8192x3072": lambda: gelu_chain(8192 * 3072),
    "big_decode_attention_48x16384x64": lambda: decode_attention(48, 16384, 64),
    "big_decode_attention_48x4096x64": lambda: decode_attention(48, 4096, 64),
    # the subgraph suite's ShuffleNet shuffle (gir_cases.py); its whole plan space: prepare ... 32
    "big_channel_shuffle_64x232x28x28": lambda: channel_shuffle(116, 28, 28, N=64),
}


# ---- prepare: enumerate, lower, rewrite, check ------------------------------------------------

def prepare(path: str, cases=None, limit: int = 8) -> None:
    from powerfusion.frontend import import_model, partition_graph
    from powerfusion.targets.specs import get_target
    t = get_target("h100")
    out = Path(path)
    done = pickle.loads(out.read_bytes()) if out.exists() else []   # this script's own output file
    have = {(p["case"], p["labels"]) for p in done}
    for case in cases or CASES:
        graph = import_model(CASES[case]())
        subs = partition_graph(graph, "cuda").subgraphs
        sub = max(subs, key=lambda s: len(s.nodes))
        done += _candidates(case, sub, graph, t, limit, have, with_default=False)
        _write(out, done)


def prepare_model(model: str, path: str, limit: int = 24) -> None:
    """Every distinct memory-bound subgraph of a real model (by structural key), each plan of it
    lowered, rewritten and checked as in `prepare` (the default plan too): the plan space of the
    kernels a model actually runs (small rows, fp16), which the synthetic cases above do not cover."""
    from powerfusion.pipeline import plancache
    from powerfusion.pipeline.driver import CompileOptions, front
    from powerfusion.targets.specs import get_target
    t = get_target("h100")
    out = Path(path)
    done = pickle.loads(out.read_bytes()) if out.exists() else []   # this script's own output file
    have = {(p["case"], p["labels"]) for p in done}
    part = front(model, "cuda", CompileOptions())
    seen, stem = set(), Path(model).stem
    for sub in part.subgraphs:
        key = plancache.structural_key(sub, part.graph, t)
        if key not in seen:
            seen.add(key)
            done += _candidates(f"{stem}:{sub.name}", sub, part.graph, t, limit, have, with_default=True)
            _write(out, done)


def _candidates(case: str, sub, graph, t, limit: int, have: set, with_default: bool) -> list[dict]:
    """The plans of `sub` (the default choice first where `with_default`) that lower, rewrite and
    pass the feasibility check, one record each; labels already in `have` are skipped (and added)."""
    from powerfusion.templates.merge import enumerate_plans, lower_subgraph
    from powerfusion.pipeline.search import feasibility
    from powerfusion.rewrite import optimise
    t0, kept = time.perf_counter(), []
    plans = ([None] if with_default else []) + enumerate_plans(sub, graph, t, limit=limit)
    for plan in plans:
        try:
            merged = lower_subgraph(sub, graph, plan, t)
            labels = tuple(lbl for _, lbl in merged.templates) if plan is None else \
                tuple(c.label for c in plan.values())
            if (case, labels) in have:
                continue
            have.add((case, labels))
            g, _ = optimise(merged)
        except Exception as e:  # a plan the lowering or the rules reject: not a candidate
            print(f"  {case}: plan rejected ({type(e).__name__}: {str(e)[:100]})", flush=True)
            continue
        why = feasibility(g, t)
        if why:
            print(f"  {case}: infeasible: {why[:120]}", flush=True)
            continue
        kept.append({"case": case, "labels": labels, "graph": g, "subgraph_nodes": len(sub.nodes),
                     "default": plan is None})
        kept += _replicated(case, labels, g, t, len(sub.nodes), have)
    print(f"{case}: {len(plans)} plans, {len(kept)} kept, {time.perf_counter() - t0:.1f}s", flush=True)
    return kept


def _replicated(case: str, labels: tuple, g, t, nodes: int, have: set) -> list[dict]:
    """The plan's form with group reductions finished by every unit (rewrite/replicate.py), a
    plan of its own (labels + 'replicated') where the rule applies and the result is feasible."""
    from powerfusion.pipeline.search import feasibility
    from powerfusion.rewrite.replicate import replicated_variant
    key = (case, labels + ("replicated",))
    if key in have:
        return []
    variant = replicated_variant(g)
    if variant is None or feasibility(variant[0], t):
        return []
    have.add(key)
    return [{"case": case, "labels": key[1], "graph": variant[0], "subgraph_nodes": nodes, "default": False}]


def _write(out: Path, done: list) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(pickle.dumps(done))


# ---- run: calibrate, predict, time, compare -----------------------------------------------------

def spearman(a, b) -> float:
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):  # ties share their mean rank
        m = x == v
        r[m] = r[m].mean()
    return r


def summarise(rows: list[dict]) -> dict:
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    per_case, gaps, top8_gaps = {}, [], []
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case]
        best = min(r["measured_s"] for r in rs)
        by_pred = sorted(rs, key=lambda r: r["predicted_s"])
        pick_gap = by_pred[0]["measured_s"] / best - 1
        top8_gap = min(r["measured_s"] for r in by_pred[:8]) / best - 1
        gaps.append(pick_gap)
        top8_gaps.append(top8_gap)
        per_case[case] = {"plans": len(rs), "spearman": spearman([r["predicted_s"] for r in rs],
                                                                 [r["measured_s"] for r in rs]),
                          "best_measured_s": best, "pick_measured_s": by_pred[0]["measured_s"],
                          "pick_gap": pick_gap, "top8_best_gap": top8_gap}
    return {"plans": len(rows), "cases": len(per_case), "spearman": spearman(pred, meas),
            "spearman_log": spearman(np.log(pred), np.log(meas)),
            "median_abs_rel_error": float(np.median([abs(p / m - 1) for p, m in zip(pred, meas)])),
            "cases_pick_within_10pct": sum(g <= 0.10 for g in gaps),
            "cases_top8_within_10pct": sum(g <= 0.10 for g in top8_gaps),
            "per_case": per_case}


_PLANS: list = []


def _compile_share(k: int, jobs: int) -> int:
    """Compile (into the disk kernel cache) every jobs-th plan's kernels, starting at k."""
    from powerfusion.backends.cuda.renderer import CUDARenderer
    from powerfusion.backends.cuda.runtime import compile_source
    n = 0
    for p in _PLANS[k::jobs]:
        try:
            for ks in CUDARenderer().render(p["graph"]):
                compile_source(ks.source, name=ks.name)
                n += 1
        except Exception:  # reported when the plan is timed
            pass
    return n


def precompile(plans: list, jobs: int = 12) -> None:
    """NVRTC is the slow part of timing many plans: compile them in forked workers first
    (before this process touches CUDA), so the timing loop only loads cached cubins."""
    import multiprocessing as mp
    global _PLANS
    _PLANS = plans
    with mp.get_context("fork").Pool(jobs) as pool:
        pool.starmap(_compile_share, [(k, jobs) for k in range(jobs)])


def run(path: str, out_dir: str, calibration: dict | None = None, budget_s: float = 170.0) -> dict:
    from powerfusion.targets.calibration import apply_calibration, load_calibration
    from powerfusion.perfmodel.cost import estimate, predict_seconds
    from powerfusion.targets.specs import get_target
    from powerfusion.pipeline.tune import time_graph
    plans = []
    for p in path.split(","):
        plans += pickle.loads(Path(p).read_bytes())
    cal = calibration or load_calibration()
    base = get_target((cal or {}).get("key") or "h100")
    t = apply_calibration(base, cal) if cal else base
    t_start = time.perf_counter()
    precompile(plans)
    print(f"precompiled {len(plans)} plans in {time.perf_counter() - t_start:.1f}s", flush=True)
    rows = []
    for k, p in enumerate(plans):
        if time.perf_counter() - t_start > budget_s:
            print(f"time budget reached: {len(plans) - k} plans not timed", flush=True)
            break
        g = p["graph"]
        est = estimate(g, t)
        row = {"index": k, "case": p["case"], "plan": " | ".join(dict.fromkeys(p["labels"])), "kernels": len(g.kernels()),
               "predicted_s": predict_seconds(est, t), "units": g.parallel.units,
               "global_bytes": est.bytes("global"), "limits": list(est.limits)}
        try:
            row["measured_s"] = time_graph(g)
        except Exception as e:  # a plan that does not compile or launch is reported, not timed
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(f"[{k + 1}/{len(plans)}] {p['case']}: predicted {row['predicted_s'] * 1e6:.2f} us, "
              f"measured {row.get('measured_s', float('nan')) * 1e6:.2f} us", flush=True)
    ok = [r for r in rows if "measured_s" in r and math.isfinite(r["predicted_s"])]
    summary = summarise(ok)
    held = [r for r in ok if r["case"] in HELD_OUT]
    if held:  # cases added after the model's constants were set from the first run
        summary["held_out"] = {k: v for k, v in summarise(held).items() if k != "per_case"}
    summary["failed"] = len(rows) - len(ok)
    summary["target"] = t.name
    summary["calibrated"] = t.calibrated
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "perfmodel-accuracy.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    (out / "perfmodel-accuracy.md").write_text(markdown(summary, rows))
    return summary


def markdown(summary: dict, rows: list[dict]) -> str:
    lines = [f"# Perf-model accuracy on {summary['target']}", "",
             f"{summary['plans']} plans over {summary['cases']} subgraphs ({summary['failed']} failed to run); "
             f"calibration: {summary['calibrated'] or 'datasheet figures'}.", "",
             f"- Spearman rank correlation (predicted vs measured, all plans): **{summary['spearman']:.3f}**",
             f"- median |predicted/measured - 1|: {summary['median_abs_rel_error']:.2f}",
             f"- cases where the model's pick is within 10% of the best measured plan: "
             f"{summary['cases_pick_within_10pct']}/{summary['cases']}",
             f"- cases where the best of the model's top-8 is within 10%: "
             f"{summary['cases_top8_within_10pct']}/{summary['cases']}", "",
             "| case | plans | Spearman | best measured (us) | pick measured (us) | pick gap | top-8 gap |",
             "|---|---|---|---|---|---|---|"]
    for case, c in summary["per_case"].items():
        lines.append(f"| {case} | {c['plans']} | {c['spearman']:.2f} | {c['best_measured_s'] * 1e6:.2f} | "
                     f"{c['pick_measured_s'] * 1e6:.2f} | {c['pick_gap'] * 100:.1f}% | {c['top8_best_gap'] * 100:.1f}% |")
    lines += ["", "| case | plan | kernels | predicted (us) | measured (us) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['plan'][:90]} | {r['kernels']} | {r['predicted_s'] * 1e6:.2f} | "
                     f"{r.get('measured_s', float('nan')) * 1e6:.2f} |")
    return "\n".join(lines) + "\n"


def rescore(path: str, measured_json: str, calibration_json: str, out_dir: str) -> dict:
    """Predict the same plans again with the current model against times measured earlier
    (no device needed); rows are matched by their index in the plans file."""
    from powerfusion.targets.calibration import apply_calibration
    from powerfusion.perfmodel.cost import estimate, predict_seconds
    from powerfusion.targets.specs import get_target
    plans = []
    for p in path.split(","):
        plans += pickle.loads(Path(p).read_bytes())
    cal = json.loads(Path(calibration_json).read_text())
    t = apply_calibration(get_target(cal.get("key") or "h100"), cal)
    old = json.loads(Path(measured_json).read_text())["rows"]
    rows = []
    for r in old:
        if "measured_s" not in r:
            continue
        g = plans[r["index"]]["graph"]
        est = estimate(g, t)
        rows.append({**r, "predicted_s": predict_seconds(est, t), "limits": list(est.limits)})
    summary = summarise([r for r in rows if math.isfinite(r["predicted_s"])])
    summary.update(failed=len(old) - len(rows), target=t.name, calibrated=t.calibrated)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "perfmodel-accuracy-rescored.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    (out / "perfmodel-accuracy-rescored.md").write_text(markdown(summary, rows))
    return summary


# ---- compile time: plan search for a whole model ----------------------------------------------

def compile_time(model: str, cache_dir: str, jobs: int = 1, limit: int = 8, beam: int = 4) -> dict:
    """Seconds to import, partition, choose a plan for every memory-bound subgraph and render
    CUDA source, with the plan cache in `cache_dir` (run twice: cold, then warm)."""
    from powerfusion import options
    from powerfusion.backends.cuda.renderer import CUDARenderer
    from powerfusion.frontend import import_model, partition_graph
    from powerfusion.pipeline.search import choose_plans
    from powerfusion.targets.specs import get_target
    import resource
    t0 = time.perf_counter()
    graph = import_model(model)
    t1 = time.perf_counter()
    part = partition_graph(graph, "cuda")
    t2 = time.perf_counter()
    with options.context(cache_dir=cache_dir):
        choices = choose_plans(part.subgraphs, graph, get_target("cuda"), jobs=jobs, limit=limit, beam=beam)
    t3 = time.perf_counter()
    kernels = sum(len(CUDARenderer().render(c.graph)) for c in choices)
    t4 = time.perf_counter()
    sources = {}
    for c in choices:
        sources[c.source] = sources.get(c.source, 0) + 1
    return {"model": Path(model).name, "subgraphs": len(choices), "distinct": len({c.key for c in choices}),
            "sources": sources, "kernels": kernels, "import_s": t1 - t0, "partition_s": t2 - t1,
            "plan_search_s": t3 - t2, "render_s": t4 - t3, "total_s": t4 - t0, "jobs": jobs,
            # wall time depends on what else the machine runs; CPU seconds of this process and its workers do not
            "cpu_s": sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                         for f in ("ru_utime", "ru_stime")),
            "limit": limit, "beam": beam}


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "prepare":
        prepare(sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else None,
                int(sys.argv[4]) if len(sys.argv) > 4 else 8)
    elif cmd == "prepare-model":
        prepare_model(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 24)
    elif cmd == "run":
        cal = json.loads(Path(sys.argv[4]).read_text()) if len(sys.argv) > 4 else None
        print(json.dumps(run(sys.argv[2], sys.argv[3], cal), indent=1, default=str))
    elif cmd == "rescore":
        print(json.dumps(rescore(*sys.argv[2:6]), indent=1, default=str))
    elif cmd == "compile-time":
        jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
        beam = int(sys.argv[5]) if len(sys.argv) > 5 else 4
        print(json.dumps(compile_time(sys.argv[2], sys.argv[3], jobs, beam=beam), indent=1))
    else:
        sys.exit(__doc__)
