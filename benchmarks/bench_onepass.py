"""One-pass statistics (powerfusion/rewrite/onepass.py) before and after, on the device: the
held-out suite's LayerNorm / softmax / RMSNorm rows (gir_cases.heldout_cases) and the norm
sweep's long rows (4096 x 65536, gir_cases.norm_cases).

"before": plans from the search without the one-pass variant; "after": the search as it is
(the variant kept where the cost model predicts it faster). Both are compiled here in worker
processes (POWERFUSION_SEARCH_BUDGET_S as set, each mode with its own plan cache), then timed
back to back in one process with bench_gir's harness (CUDA-graph replay over rotated input
sets beyond 2x L2), each checked against torch eager first; torch.compile is timed for as many
cases as the time budget leaves.

    PYTHONPATH=$PWD python3 benchmarks/bench_onepass.py --out DIR [--budget-s 200] [--jobs 12]
"""
from __future__ import annotations

import argparse
import ast
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gir_cases  # noqa: E402

HELD = ("add_layernorm", "scale_mask_softmax", "rmsnorm_swiglu")
MODES = ("before", "after")


def cases():
    held = [c for c in gir_cases.heldout_cases() if c.name.startswith(HELD)]
    only = os.environ.get("ONEPASS_ONLY")   # a substring of case names (for a quick local check)
    # M = 4096 rows of 65536 (1 GiB in fp32, far beyond L2), as bench_norms.py caps them: at
    # M = 32768 lowering and rewriting the subgraph takes minutes of CPU per plan (measured:
    # 323 s on a loaded 2-core machine), more than a device call has
    return [c for c in held + gir_cases.norm_cases(m=4096, ns=(65536,)) if not only or only in c.name]


def _compile(args):
    key, model, out = args
    from powerfusion.compiler import compile_model
    from powerfusion.rewrite.onepass import ONEPASS_RULES
    t0 = time.perf_counter()
    try:
        plan = compile_model(model, "cuda")
    except Exception as e:
        return key, f"{type(e).__name__}: {str(e)[:300]}", False
    Path(out, f"{key}.pkl").write_bytes(pickle.dumps(plan))
    used = any(s.rule in ONEPASS_RULES for k in plan.kernel_steps for s in k.trace)
    return key, round(time.perf_counter() - t0, 1), used


def compile_mode(mode: str, plans: Path, jobs: int) -> dict:
    """Compile every case for one mode (run in its own process: its own plan cache)."""
    from precompile import case_key
    if mode == "before":
        import powerfusion.pipeline.search as search
        search._one_pass = lambda c, t: None   # the search as it was: no one-pass variant
    out = plans / mode
    out.mkdir(parents=True, exist_ok=True)
    work = [(case_key(c), c.model.SerializeToString(), str(out)) for c in cases()]
    with mp.get_context("fork").Pool(max(1, jobs)) as pool:
        return {k: (s, used) for k, s, used in pool.map(_compile, work, chunksize=1)}


def _compile_all(plans: Path, jobs: int) -> dict:
    procs = {}
    for mode in MODES:
        env = {**os.environ, "POWERFUSION_CACHE_DIR": str(plans / f"cache-{mode}")}
        procs[mode] = subprocess.Popen([sys.executable, __file__, "--compile", mode, "--plans", str(plans),
                                        "--jobs", str(max(1, jobs // 2))], env=env, stdout=subprocess.PIPE, text=True)
    return {mode: ast.literal_eval(p.communicate()[0].strip().splitlines()[-1]) for mode, p in procs.items()}


def time_cases(plans: Path, info: dict, budget_s: float, start: float, save) -> tuple[list[dict], float, int]:
    import torch
    from baselines import bench_torch, torch_impls
    from bench_gir import Ours, make_inputs
    from harness import copy_bandwidth, input_sets_needed, l2_bytes, time_torch
    from precompile import case_key
    copy_bw, l2 = copy_bandwidth(), l2_bytes()
    rows = []
    for case in cases():
        key = case_key(case)
        shape = list(next(iter(case.inputs.values()))[0])
        base = {"case": case.name, "dtype": case.dtype, "shape": shape, "suite": case.suite, "bytes": case.bytes}
        sets = [make_inputs(case, s) for s in range(input_sets_needed(case.bytes, l2))]
        want = case.torch_fn(*sets[0])
        want = want[0] if isinstance(want, tuple) else want
        for mode in MODES:
            row = {**base, "impl": f"powerfusion-{mode}", "compile_s": info[mode][key][0],
                   "one_pass": info[mode][key][1]}
            try:
                ours = Ours(case, plans / mode)
                got = ours(*sets[0])
                got = got[0] if isinstance(got, tuple) else got
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                t = time_torch(ours, sets)
                row.update(kernels=ours.kernels, rel_err_vs_eager=err, device_time_s=t.device_time_s,
                           bw_fraction=case.bytes / t.device_time_s / copy_bw)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, flush=True)
        if time.perf_counter() - start < budget_s:
            fn = {"torch-compile": torch_impls(case.torch_fn)["torch-compile"]}
            try:
                rows += bench_torch(case.name, case.dtype, tuple(shape), fn, lambda: sets[0], case.bytes,
                                    copy_bw, l2, case.bytes)
                print(rows[-1], flush=True)
            except Exception as e:
                rows.append({**base, "impl": "torch-compile", "error": f"{type(e).__name__}: {str(e)[:200]}"})
        del sets, want
        torch.cuda.empty_cache()
        save(rows, copy_bw, l2)   # after every case: a run cut short keeps what it measured
    return rows, copy_bw, l2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--plans", default="build/plans-onepass")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--compile", default=None, choices=MODES, help="(internal) compile one mode and print")
    args = ap.parse_args(argv)
    plans = Path(args.plans)
    if args.compile:
        print(repr(compile_mode(args.compile, plans, args.jobs)))
        return 0
    start = time.perf_counter()
    info = _compile_all(plans, args.jobs)
    print(f"compiled in {time.perf_counter() - start:.0f} s: {info}", flush=True)
    def save(rows, copy_bw, l2):
        from harness import run_metadata, write_results
        meta = run_metadata(copy_bandwidth_GBps=round(copy_bw / 1e9, 1), l2_bytes=l2,
                            search_budget_s=os.environ.get("POWERFUSION_SEARCH_BUDGET_S", "10"),
                            notes=["before: the search without the one-pass variant; after: with it",
                                   "bytes = compulsory; device time: CUDA-graph replay over rotated input sets"])
        write_results("gir-onepass", rows, meta, args.out)
    time_cases(plans, info, args.budget_s, start, save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
