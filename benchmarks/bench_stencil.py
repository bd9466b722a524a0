"""Depthwise convs: the plan the search picks against each conv template forced, and torch.

For every case of the `dwconv` suite (gir_cases.dwconv_cases: ConvNeXt-T 7x7 with bias at its
four stages, EfficientNet-B0 3x3 + BN + SiLU) the rows of bench_gir.run_case (ours as the
search picks it, torch eager, torch.compile), then one row per candidate of the conv node
(`impl` = "pf:<template label>"): the same pipeline with the conv offered only that candidate
(the BatchNorm and activation still merged by the search), so the table shows what the stencil
template gains over the gather templates and whether the search picked the fastest.
Device time by CUDA-graph replay over rotated input sets (> 2x L2), as in bench_gir.

    PYTHONPATH=$PWD python3 benchmarks/bench_stencil.py [--out DIR] [--budget-s 240] [--only 768]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gir_cases  # noqa: E402
from bench_gir import TOL, Ours, error_row, make_inputs, run_case, run_cases, summary  # noqa: E402
from harness import copy_bandwidth, input_sets_needed, l2_bytes, run_metadata, time_torch, write_results  # noqa: E402


def conv_labels(case) -> list[str]:
    """The template labels the conv node of the case is offered on the CUDA target."""
    from powerfusion import basic as B
    from powerfusion.pipeline.driver import CompileOptions, front
    from powerfusion.plan import Timer
    from powerfusion.templates import buffer_names, candidates
    part = front(case.model, "cuda", CompileOptions(), (), Timer())
    g = part.graph
    node = next(n for n in g.nodes if isinstance(n.op, B.Conv))
    return [c.label for c in candidates(node, g.tensors, "cuda", buffer_names(list(g.tensors)))]


class forced_conv:
    """Within the block the Conv's templates offer only the candidate labelled `label`, the plan
    and compile caches live in a fresh folder and the decisions held in memory are forgotten on
    entry and exit (all are keyed by the subgraph, not by the templates offered)."""

    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        from powerfusion import basic as B
        from powerfusion import options
        from powerfusion import templates as T
        from powerfusion.pipeline import plancache
        plancache.clear_memo()
        self.orig = T.TEMPLATES[B.Conv]
        T.TEMPLATES[B.Conv] = lambda ctx: [c for c in self.orig(ctx) if c.label == self.label]
        self.tmp = tempfile.TemporaryDirectory()
        self.ctx = options.context(cache_dir=self.tmp.name)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        from powerfusion import basic as B
        from powerfusion import templates as T
        from powerfusion.pipeline import plancache
        T.TEMPLATES[B.Conv] = self.orig
        plancache.clear_memo()
        self.ctx.__exit__(*exc)
        self.tmp.cleanup()


def forced_row(case, label, copy_bw, l2, want) -> dict:
    import torch
    base = {"suite": case.suite, "case": case.name, "dtype": case.dtype, "impl": f"pf:{label}",
            "shape": list(next(iter(case.inputs.values()))[0])}
    with forced_conv(label):
        ours = Ours(case)
    sets = [make_inputs(case, s) for s in range(input_sets_needed(case.bytes, l2))]
    got = ours(*sets[0])
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
    row = {**base, "kernels": ours.kernels, "rel_err_vs_eager": err, "bytes": case.bytes}
    if not err <= TOL[case.dtype]:
        return {**row, "error": f"wrong numbers: relative error {err:.3g} > {TOL[case.dtype]}"}
    t = time_torch(ours, sets)
    del sets
    torch.cuda.empty_cache()
    return {**row, "device_time_s": t.device_time_s, "latency_s": t.latency_s, "timing_method": t.method,
            "input_sets": t.sets, "bw_fraction": case.bytes / t.device_time_s / copy_bw}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--no-forced", action="store_true", help="only the searched plan and torch")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    copy_bw, l2 = copy_bandwidth(), l2_bytes()
    cases = [c for c in gir_cases.cases_for(["dwconv"]) if not args.only or args.only in c.name]
    def rows_of(case) -> list[dict]:
        rows = run_case(case, copy_bw, l2)
        want = case.torch_fn(*make_inputs(case, 0))
        for label in ([] if args.no_forced else conv_labels(case)):
            try:
                rows.append(forced_row(case, label, copy_bw, l2, want))
            except Exception as e:
                rows.append(error_row(case, f"pf:{label}", e, 300))
        return rows
    rows = run_cases(cases, rows_of, start + args.budget_s)
    meta = run_metadata(copy_bandwidth_GBps=round(copy_bw / 1e9, 1), l2_bytes=l2, summary=summary(rows),
                        notes=["bytes = compulsory: input read once + output written once",
                               "device time: CUDA-graph replay over rotated input sets exceeding 2x L2",
                               "pf:<label>: the conv offered only that template candidate (search for the rest)",
                               f"ours is checked against torch eager before timing (tolerance per dtype: {TOL})"])
    write_results("gir-dwconv", rows, meta, args.out)
    print(meta["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
