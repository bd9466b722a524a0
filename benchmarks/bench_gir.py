"""PowerFusion against torch eager and torch.compile on memory-bound work (issue: CUDA backend
benchmarks). Suites:
  norms      LayerNorm, RMSNorm, softmax; fp32 and bf16; M = 32768 x N in {256 ... 65536}
  subgraphs  memory-bound subgraphs cut from BERT, GPT-2 (prefill; decode attention, KV 1K-32K),
             ViT, ShuffleNet, EfficientNet, SAR-DRN, RedNet at realistic sizes (gir_cases.py)
  heldout    subgraphs at shapes of models the search was not tuned on (ShuffleNetV2, GPT-2 medium,
             BERT-large, LLaMA-7B decode, EfficientNet-B0, TinyLlama); batch 1 and 8, fp32 and bf16
  decode     decode attention, KV 1K-32K: GPT-2 MHA and LLaMA-style GQA (32 over 8 KV heads), fp32, bf16
  dwconv     depthwise convs: ConvNeXt-T 7x7 at its four stages (fp32, fp16), EfficientNet-B0
             3x3 + BN + SiLU (batch 1, 8, 32); bench_stencil.py adds the per-template rows
  models     whole committed small models (latency-bound; reported, not part of the geomeans)

Every row: device time (CUDA-graph replay over input sets that exceed 2x L2), per-call latency,
compulsory bytes / device time as a fraction of the copy bandwidth measured in the same run,
kernel count. Ours is checked against torch eager before it is timed.

    PYTHONPATH=$PWD python3 benchmarks/bench_gir.py --suite norms subgraphs --out DIR
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gir_cases  # noqa: E402
from baselines import bench_torch, torch_impls  # noqa: E402
from harness import copy_bandwidth, input_sets_needed, l2_bytes, run_metadata, time_torch, write_results  # noqa: E402

TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}  # max |ours - eager| / max |eager|


def make_inputs(case, seed):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for name, (shape, kind) in case.inputs.items():
        x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        out.append(x.to(getattr(torch, case.dtype)))
    return tuple(out)


class Ours:
    """A compiled single-subgraph plan bound to torch tensors (zero copy)."""

    def __init__(self, case, plans_dir=None):
        from powerfusion.backends.cuda.executor import GIRExecutor
        from powerfusion.compiler import compile_model
        from precompile import case_key, load_plan
        t0 = time.perf_counter()
        self.plan = load_plan(plans_dir, case_key(case)) if plans_dir else None
        if self.plan is None and plans_dir:
            raise RuntimeError("not compiled in the precompile step (see compile.json)")
        self.plan = self.plan or compile_model(case.model, "cuda")
        self.compile_s = sum(self.plan.timings.values())
        self.input_names = list(case.inputs)
        self.output_names = [o.name for o in case.model.graph.output]
        self.out_shapes = {o.name: tuple(d.dim_value for d in o.type.tensor_type.shape.dim)
                           for o in case.model.graph.output}
        self.dtype = case.dtype
        t0 = time.perf_counter()
        self.decode = _decode_runner(self.plan)
        if self.decode is not None:   # a decode attention: our split-KV kernel, one library step
            self.load_s, self.kernels = time.perf_counter() - t0, self.decode.kernels
            return
        if self.plan.library_steps or len(self.plan.kernel_steps) != 1:
            raise RuntimeError(f"expected one memory-bound subgraph, got {len(self.plan.kernel_steps)} "
                               f"and {len(self.plan.library_steps)} library call(s)")
        self.step = self.plan.kernel_steps[0]
        self.ex = GIRExecutor(self.step.gir)
        self.load_s = time.perf_counter() - t0
        self.tensor_of = self.step.buffers
        self.kernels = len(self.step.gir.kernels())

    def __call__(self, *inputs):
        import cupy
        import torch
        if self.decode is not None:
            out = torch.empty(self.out_shapes[self.output_names[0]], device="cuda", dtype=getattr(torch, self.dtype))
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                self.decode(*(_as_cupy(t) for t in inputs), _as_cupy(out))
            return out
        env = dict(zip(self.input_names, inputs))
        outs = [torch.empty(self.out_shapes[n], device="cuda", dtype=getattr(torch, self.dtype))
                for n in self.output_names]
        env.update(zip(self.output_names, outs))
        arrays = {}
        for b in self.step.gir.inputs + self.step.gir.outputs:
            t = env[self.tensor_of[b]]
            arrays[b] = _as_cupy(t)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.ex(arrays, stream=stream)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _decode_runner(plan):
    """The split-KV kernel (backends/cuda/decode_attention.py) where the plan is one decode
    attention library step and nothing else, else None."""
    from powerfusion.backends.cuda.decode_attention import plan_decode
    from powerfusion.basic import Attention
    steps = plan.library_steps
    if plan.kernel_steps or len(steps) != 1 or not isinstance(steps[0].call.node.op, Attention):
        return None
    routes, why = plan_decode(plan.graph, [steps[0].call.node])
    if not routes:
        raise RuntimeError(f"decode attention not taken by the split-KV kernel: {why}")
    return next(iter(routes.values()))


def _as_cupy(t):
    import cupy
    import torch
    if t.dtype == torch.bfloat16:
        return cupy.asarray(t.view(torch.int16)).view(cupy.uint16).reshape(-1)
    return cupy.asarray(t).reshape(-1)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def run_case(case, copy_bw, l2, plans_dir=None) -> list[dict]:
    import torch
    shape = list(next(iter(case.inputs.values()))[0])
    base = {"suite": case.suite, "case": case.name, "dtype": case.dtype, "shape": shape}
    try:
        ours = Ours(case, plans_dir)
    except Exception as e:
        return [{**base, "impl": "powerfusion", "error": f"{type(e).__name__}: {str(e)[:400]}"}]
    sets = [make_inputs(case, s) for s in range(input_sets_needed(case.bytes, l2))]
    want = case.torch_fn(*sets[0])
    got = ours(*sets[0])
    torch.cuda.synchronize()
    errs = []
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        errs.append(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)))
    err = max(errs)
    del want, got
    row = {**base, "impl": "powerfusion", "kernels": ours.kernels, "compile_s": round(ours.compile_s, 3),
           "nvrtc_load_s": round(ours.load_s, 3), "rel_err_vs_eager": err, "bytes": case.bytes}
    if not err <= TOL[case.dtype]:
        row["error"] = f"wrong numbers: relative error {err:.3g} > {TOL[case.dtype]}"
        rows = [row]
    else:
        t = time_torch(ours, sets)
        row.update(device_time_s=t.device_time_s, latency_s=t.latency_s, timing_method=t.method,
                   input_sets=t.sets, bw_fraction=case.bytes / t.device_time_s / copy_bw)
        rows = [row]
    rows += [{**r, "suite": case.suite} for r in
             bench_torch(case.name, case.dtype, tuple(shape), torch_impls(case.torch_fn), lambda: sets[0],
                         case.bytes, copy_bw, l2, case.bytes)]
    by = {r["impl"]: r for r in rows}
    if "device_time_s" in by["powerfusion"]:
        for impl in ("torch-eager", "torch-compile"):
            if "device_time_s" in by.get(impl, {}):
                by["powerfusion"][f"speedup_vs_{impl}"] = by[impl]["device_time_s"] / by["powerfusion"]["device_time_s"]
    del sets
    torch.cuda.empty_cache()
    return rows


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(rows) -> dict:
    out = {}
    for suite in sorted({r["suite"].split("/")[0] for r in rows}):
        ours = [r for r in rows if r["impl"] == "powerfusion" and r["suite"].startswith(suite)]
        ok = [r for r in ours if "device_time_s" in r]
        out[suite] = {"cases": len(ours), "measured": len(ok),
                      "geomean_bw_fraction": geomean([r["bw_fraction"] for r in ok]),
                      "geomean_speedup_vs_torch_compile": geomean([r.get("speedup_vs_torch-compile") for r in ok]),
                      "geomean_speedup_vs_torch_eager": geomean([r.get("speedup_vs_torch-eager") for r in ok]),
                      "torch_compile_geomean_bw_fraction": geomean(
                          [r["bw_fraction"] for r in rows if r["impl"] == "torch-compile" and r["suite"].startswith(suite)
                           and "bw_fraction" in r]),
                      "worst": sorted(((r.get("bw_fraction", 0), r["case"], r["dtype"]) for r in ours))[:3]}
    return out


def error_row(case, impl: str, e: Exception, limit: int = 400) -> dict:
    return {"suite": case.suite, "case": case.name, "dtype": case.dtype, "impl": impl,
            "error": f"{type(e).__name__}: {str(e)[:limit]}"}


def run_cases(cases, run, deadline: float) -> list[dict]:
    """`run(case)` -> rows for each case, printed as they come; a case that raises gives one error
    row, and cases left when perf_counter() passes `deadline` are rows saying so."""
    rows = []
    for case in cases:
        if time.perf_counter() > deadline:
            rows.append({"suite": case.suite, "case": case.name, "dtype": case.dtype, "impl": "powerfusion",
                         "error": "not run: benchmark time budget spent"})
            continue
        try:
            new = run(case)
        except Exception as e:
            traceback.print_exc()
            new = [error_row(case, "powerfusion", e)]
        for r in new:
            print(_line(r), flush=True)
        rows += new
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", nargs="+", default=["norms", "subgraphs"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--dtypes", nargs="+", default=None, help="only cases of these dtypes")
    ap.add_argument("--plans", default=None, help="folder of precompiled plans (precompile.py)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    copy_bw, l2 = copy_bandwidth(), l2_bytes()
    cases = gir_cases.cases_for([s for s in args.suite if s != "models"])   # in the order given
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    if args.dtypes:
        cases = [c for c in cases if c.dtype in args.dtypes]
    rows = run_cases(cases, lambda case: run_case(case, copy_bw, l2, args.plans), start + args.budget_s)
    meta = run_metadata(copy_bandwidth_GBps=round(copy_bw / 1e9, 1), l2_bytes=l2, summary=summary(rows),
                        notes=["bytes = compulsory: inputs read once + outputs written once (+ parameters)",
                               "device time: CUDA-graph replay (torch.cuda.CUDAGraph) over rotated input sets "
                               "exceeding 2x L2; latency: one call + synchronize, median",
                               "ours is checked against torch eager before timing (tolerance per dtype: "
                               f"{TOL})"])
    write_results("gir-" + "-".join(args.suite), rows, meta, args.out)
    print(meta["summary"])
    return 0


def _line(r) -> str:
    if "error" in r:
        return f"{r['case']:<40} {r['dtype']:<9} {r['impl']:<14} ERROR {r['error'][:200]}"
    return (f"{r['case']:<40} {r['dtype']:<9} {r['impl']:<14} {r['device_time_s'] * 1e6:9.1f} us "
            f"{r.get('bw_fraction', 0):5.2f} bw  k={r.get('kernels')}")


if __name__ == "__main__":
    sys.exit(main())
