"""Every enumerated plan of benchmark cases, predicted and timed (a diagnostic: which template
family is fastest on the device, and does the model agree).

    PYTHONPATH=$PWD python3 benchmarks/diag/plan_variants.py prepare rmsnorm_32768x256-bfloat16,... OUT.pkl [LIMIT]
    PYTHONPATH=$PWD python3 benchmarks/diag/plan_variants.py prepare-model MODEL.onnx sg2,sg9 OUT.pkl [LIMIT]
    PYTHONPATH=$PWD python3 benchmarks/diag/plan_variants.py run OUT.pkl          # on the GPU

Keys are gir_cases names with the dtype (precompile.case_key); `prepare-model` takes a model's
subgraphs by name (as `powerfusion compile` names them) and adds the search's own pick, labelled
"searched". Timing: CUDA-graph replay with
inputs rotated past the L2 (pipeline.tune.time_graph).
"""
from __future__ import annotations

import math
import pickle
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _short(label: str) -> str:
    m = re.match(r"([\w.]+)\((.*)\)", label)
    if not m:
        return label
    kv = dict(x.split("=") for x in m.group(2).split(", "))
    extra = "".join(f"/{k[0]}{v}" for k, v in kv.items()
                    if k in ("per_row", "rows", "group", "channels") and v not in ("0", "1"))
    extra += f"/{kv['layout']}" if "layout" in kv else ""
    return f"{m.group(1).split('.')[-1]}/{kv.get('vec', '')}{extra}"


def _plan_rows(case: str, sub, graph, t, limit: int, default: bool) -> list[dict]:
    """Every enumerated plan of `sub` (and, with `default`, the lowering's default first),
    rewritten; the ones the rewrite or the renderer's checks reject are left out."""
    from powerfusion.pipeline.search import feasibility
    from powerfusion.rewrite import optimise
    from powerfusion.templates.merge import enumerate_plans, lower_subgraph, lowering_context
    ctx = lowering_context(sub, graph, t)
    rows = []
    for plan in ([None] if default else []) + enumerate_plans(sub, graph, t, limit=limit, ctx=ctx):
        try:
            g, _ = optimise(lower_subgraph(sub, graph, plan, t, ctx=ctx))
        except Exception as e:
            print(f"{case}: rejected ({type(e).__name__})", flush=True)
            continue
        if feasibility(g, t):
            continue
        labels = "default" if plan is None else " ".join(_short(c.label) for c in plan.values())
        rows.append({"case": case, "labels": labels, "graph": g})
    print(f"{case}: {len(rows)} plans", flush=True)
    return rows


def prepare(keys: list[str], out: str, limit: int = 40) -> None:
    import gir_cases
    from precompile import case_key
    from powerfusion.pipeline.driver import front
    from powerfusion.targets.specs import get_target
    t = get_target("cuda")
    rows = []
    for case in gir_cases.norm_cases() + gir_cases.subgraph_cases():
        if case_key(case) not in keys:
            continue
        part = front(case.model, "cuda")     # the session's import: its basic-graph folds included
        sub = max(part.subgraphs, key=lambda s: len(s.nodes))
        rows += _plan_rows(case_key(case), sub, part.graph, t, limit, default=False)
    Path(out).write_bytes(pickle.dumps(rows))


def prepare_model(model: str, names: list[str], out: str, limit: int = 64) -> None:
    from powerfusion.pipeline.driver import front
    from powerfusion.pipeline.search import choose_plan
    from powerfusion.targets.specs import get_target
    t = get_target("cuda")
    part = front(model, "cuda")
    rows = []
    for sub in part.subgraphs:
        if sub.name not in names:
            continue
        case = f"{Path(model).stem}:{sub.name}"
        choice = choose_plan(sub, part.graph, t, cache=False)
        rows.append({"case": case, "labels": "searched " + " ".join(_short(x) for x in choice.labels),
                     "graph": choice.graph})
        rows += _plan_rows(case, sub, part.graph, t, limit, default=True)
    Path(out).write_bytes(pickle.dumps(rows))


def run(path: str) -> None:
    from powerfusion.perfmodel.cost import estimate, predict_seconds
    from powerfusion.targets.specs import get_target
    from powerfusion.pipeline.tune import time_graph
    t = get_target("cuda")
    rows = pickle.loads(Path(path).read_bytes())
    seen = set()
    for r in rows:
        key = (r["case"], r["labels"])
        if key in seen:
            continue
        seen.add(key)
        try:
            r["measured_s"] = time_graph(r["graph"])
        except Exception as e:
            r["measured_s"] = math.inf
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(r["error"], flush=True)
        r["predicted_s"] = predict_seconds(estimate(r["graph"], t), t)
        print(f"{r['case']:34s} {r['measured_s'] * 1e6:9.1f} us  predicted {r['predicted_s'] * 1e6:9.1f} us  "
              f"k={len(r['graph'].kernels())}  {r['labels']}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare(sys.argv[2].split(","), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 40)
    elif sys.argv[1:2] == ["prepare-model"]:
        prepare_model(sys.argv[2], sys.argv[3].split(","), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 64)
    elif sys.argv[1:2] == ["run"]:
        run(sys.argv[2])
    else:
        sys.exit(__doc__)
