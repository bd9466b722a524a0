"""LLM decode: one decode step of a LLaMA-7B-width decoder (decode_llm_model.py), fp16 and
weight-quantised, PowerFusion against torch eager and torch.compile fp16.

    PYTHONPATH=$PWD python3 benchmarks/bench_decode_llm.py --out DIR [--layers 2] [--past 1024]
        [--batches 1,16] [--variants int4,nf4,int2a8] [--budget 270]

Model: hidden 4096, MLP 11008, 32 heads of 128 (MHA, as LLaMA-7B), `layers` layers, seeded
random fp16 weights, a KV cache of `past` tokens per layer as inputs; built with onnx.helper on
the machine that runs it (2 layers hold 808 MB of weights). Variants: the fp16 model and
`powerfusion quantize-weights` of it (--dtype int4 --group 128 -> MatMulNBits W4A16; nf4 ->
MatMulLowBit; int2 --act int8 -> W2A8).

Per batch and implementation: device time of one step by CUDA-graph replay (harness.time_torch
for torch; bench_models.graph_replay_times for PowerFusion sessions built with cuda_graph, where
any step not captured runs eagerly between the captured pieces and its gaps count), per-call
latency (wall time of a call plus a synchronize, median), kernels per step, and the error of
output y: max |y - ref| / max |ref| against torch eager fp16 of the same weights (the quantised
variants against torch eager with the dequantised weights). Tolerances: 2e-2 for fp16 and
weight-only variants (fp16 rounding through the layers), 5e-2 for W2A8 (int8 activations are
rounded per row, which the weight reference does not do). `vs_compile` = device time /
torch.compile fp16's at the same batch (the goal for W4A16 at batch 1: <= 0.45). Rows are
written after each measurement, so a run cut short keeps what it measured; a row not reached
within --budget seconds says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_llm_model import (DecoderConfig, build_decoder_onnx, make_inputs, make_weights,  # noqa: E402
                              quantize_decoder, torch_decode_module, with_batch)

VARIANTS = {"int4": ("int4", None, "W4A16 g128"), "nf4": ("nf4", None, "NF4 g128"),
            "int2a8": ("int2", "int8", "W2A8 g128")}
TOLERANCE = {"fp16": 2e-2, "int4": 2e-2, "nf4": 2e-2, "int2a8": 5e-2}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


class Bench:
    """Shared state of one run: the fp16 weights and model, quantised models, rows."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.cfg = DecoderConfig(layers=args.layers, past=args.past)
        self.weights = make_weights(self.cfg)
        self.model = build_decoder_onnx(self.cfg, self.weights)
        self.quantised: dict[str, tuple] = {}
        self.rows: list[dict] = []
        self.kept_rows, self.kept_meta = _kept(args.keep)
        self.run = len(self.kept_meta.get("runs", []))

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.t0)

    def case(self, b: int) -> str:
        return f"llama7b-{self.cfg.layers}L-b{b}-kv{self.cfg.past}"

    def feeds(self, b: int) -> dict:
        return make_inputs(dataclasses.replace(self.cfg, batch=b))

    def add(self, row: dict) -> None:
        row.update(run=self.run, t_s=round(time.perf_counter() - self.t0, 1))
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        write(self)


# ---- torch ------------------------------------------------------------------------------
def run_torch(bench: Bench, b: int, impl: str, weights=None, variant: str = "fp16") -> np.ndarray | None:
    """Time torch eager / torch.compile on batch b (or just compute the reference for a
    weight variant when impl is "reference"); returns y from torch eager."""
    import torch
    from harness import count_torch_kernels, time_torch
    cfg = dataclasses.replace(bench.cfg, batch=b)
    module = torch_decode_module(cfg, weights or bench.weights)
    feeds = bench.feeds(b)
    args = tuple(torch.from_numpy(feeds[n]).cuda() for n in _input_names(cfg))
    row = {"case": bench.case(b), "batch": b, "dtype": variant, "impl": impl}
    try:
        with torch.no_grad():
            y = module(*args)[0].float().cpu().numpy()
            if impl == "reference":
                return y
            fn = module if impl == "torch-eager" else torch.compile(module, dynamic=False)
            t = time.perf_counter()
            out = fn(*args)[0].float().cpu().numpy()
            row["build_s"] = time.perf_counter() - t
            row["max_rel_err"] = rel_err(out, y)
            timing = time_torch(fn, [args], latency_calls=30)
            row.update(device_time_s=timing.device_time_s, latency_s=timing.latency_s,
                       timing_method=timing.method, kernels=count_torch_kernels(fn, args))
        return y
    except Exception as e:
        row["error"] = _one_line(e)
        traceback.print_exc()
        return None
    finally:
        if impl != "reference":
            bench.add(row)
        del module
        torch.cuda.empty_cache()


def _input_names(cfg: DecoderConfig) -> list[str]:
    return ["x", "cos", "sin", *[f"past_{c}{i}" for i in range(cfg.layers) for c in "kv"]]


# ---- ours -------------------------------------------------------------------------------
def run_ours(bench: Bench, b: int, variant: str, ref: np.ndarray | None) -> None:
    import cupy
    from bench_models import graph_replay_times
    from harness import _latency
    from powerfusion import InferenceSession
    model = bench.model if variant == "fp16" else bench.quantised[variant][0]
    row = {"case": bench.case(b), "batch": b, "dtype": variant, "impl": "powerfusion"}
    stage = "build"
    try:
        t = time.perf_counter()
        sess = InferenceSession(with_batch(model, b).SerializeToString(), target="cuda",
                                options={"cuda_graph": True})
        row["build_s"] = time.perf_counter() - t
        stage = "run"
        feeds = {k: cupy.asarray(v) for k, v in bench.feeds(b).items()}
        wanted = {o.name: ("cuda", None) for o in sess.graph.outputs}
        out = sess.run_bound(feeds, wanted)
        row["max_rel_err"] = rel_err(cupy.asnumpy(out["y"]), ref) if ref is not None else None
        row["tolerance"] = TOLERANCE[variant]
        row["within_tolerance"] = None if ref is None else row["max_rel_err"] <= TOLERANCE[variant]
        stage = "time"
        row["device_time_s"] = statistics.median(graph_replay_times(sess))
        row["latency_s"] = _latency(lambda i: sess.run_bound(feeds, wanted), cupy.cuda.Device().synchronize, 30)
        runner = sess._executor
        plan = runner.plan
        row["library_steps"] = len(plan.library_steps)
        row["generated_kernels"] = sum(len(k.kernels) for k in plan.kernel_steps)
        row["decode_attention"] = f"{len(runner.decodes)} split-KV, {sum(d.shape.tail > 0 for d in runner.decodes.values())} reading the new token in place"
        row["fallbacks"] = {k: str(v)[:200] for k, v in runner.fallbacks.items()}
        kinds = [k for k, _ in runner._cuda_graph]
        row["timing_method"] = (f"cuda-graph replay ({kinds.count('graph')} graph pieces, "
                                f"{kinds.count('eager')} eager pieces between)")
        stage = "profile"
        row["profile"] = _profile(runner)
        row["kernels"] = row["profile"]["kernels"]
    except Exception as e:
        row["error"] = f"{stage}: {_one_line(e)}"
        traceback.print_exc()
    bench.add(row)


def _profile(runner) -> dict:
    """Kernels of one replayed step by category and the top kernels (kernel_profile.py)."""
    import torch
    from kernel_profile import profile_calls, summarize
    s = summarize(profile_calls(runner._replay, calls=1, synchronize=torch.cuda.synchronize), 1)
    s["kernels"] = sum(int(c["kernels"]) for c in s["categories"].values())
    return s


def quantise(bench: Bench, variant: str) -> None:
    dtype, act, _ = VARIANTS[variant]
    t = time.perf_counter()
    q, op, dequantised = quantize_decoder(bench.model, dtype, act, processes=os.cpu_count() or 1)
    bench.quantised[variant] = (q, {**bench.weights, **dequantised}, time.perf_counter() - t, op)


# ---- the run ----------------------------------------------------------------------------
def plan(batches: list[int], variants: list[str]) -> list[tuple]:
    """Steps in priority order: torch.compile fp16 and the first weight type at every batch (the
    goal), then torch eager and our fp16 at every batch, then the other weight types."""
    first = [("torch-compile", b, "fp16") for b in batches[:1]] + [("torch-eager", b, "fp16") for b in batches[:1]]
    steps = []
    for b in batches:
        steps += ([] if b == batches[0] else [("torch-compile", b, "fp16")]) + \
            [("powerfusion", b, v) for v in variants[:1]]
    for b in batches:
        steps += ([] if b == batches[0] else [("torch-eager", b, "fp16")]) + [("powerfusion", b, "fp16")]
    steps += [("powerfusion", b, v) for v in variants[1:] for b in batches]
    return first + steps


def parse_steps(text: str) -> list[tuple]:
    """"1:torch-compile,1:int4,16:fp16" -> [("torch-compile", 1, "fp16"), ("powerfusion", 1, "int4"), ...]."""
    steps = []
    for item in text.split(","):
        b, _, what = item.partition(":")
        if not b.isdigit() or what not in ("torch-compile", "torch-eager", "fp16", *VARIANTS):
            raise SystemExit(f"--steps: '{item}' is not BATCH:(torch-compile|torch-eager|fp16|{'|'.join(VARIANTS)})")
        steps.append((what, int(b), "fp16") if what.startswith("torch") else ("powerfusion", int(b), what))
    return steps


ROW_S = 45   # a PowerFusion row (quantise, reference, build, time): no row starts with less left


def execute(bench: Bench, steps: list[tuple]) -> None:
    refs: dict[tuple, np.ndarray | None] = {}
    for impl, b, variant in steps:
        if bench.left() < ROW_S:
            bench.add({"case": bench.case(b), "batch": b, "dtype": variant, "impl": impl,
                       "error": f"not run: the {bench.args.budget:.0f} s budget was spent"})
            continue
        if impl.startswith("torch"):
            y = run_torch(bench, b, impl)
            refs.setdefault((b, "fp16"), y)
            continue
        if variant != "fp16" and variant not in bench.quantised:
            quantise(bench, variant)
        if (b, variant) not in refs:
            w = None if variant == "fp16" else bench.quantised[variant][1]
            refs[(b, variant)] = run_torch(bench, b, "reference", w, variant)
        run_ours(bench, b, variant, refs[(b, variant)])


def summary(rows: list[dict]) -> list[dict]:
    """Per run and batch: each row's device time over torch.compile fp16's in the same run."""
    base = {(r.get("run", 0), r["batch"]): r["device_time_s"] for r in rows
            if r["impl"] == "torch-compile" and r.get("device_time_s")}
    for r in rows:
        key = (r.get("run", 0), r["batch"])
        if r.get("device_time_s") and key in base:
            r["vs_compile"] = r["device_time_s"] / base[key]
    return rows


def _kept(path: str | None) -> tuple[list[dict], dict]:
    """(rows, meta) of an earlier run to keep beside this one (--keep), each row tagged with its run."""
    if not path:
        return [], {}
    doc = json.loads(Path(path).read_text())
    meta = doc["meta"]
    runs = meta.get("runs") or [{"date": meta["date"], "git_commit": meta["git_commit"]}]
    for r in doc["rows"]:
        r.setdefault("run", 0)
    return doc["rows"], {**meta, "runs": runs}


def write(bench: Bench) -> None:
    from harness import run_metadata
    out = Path(bench.args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept = bench.kept_meta
    meta = run_metadata(suite="decode-llm", config=dataclasses.asdict(bench.cfg),
                        quantise_s={**kept.get("quantise_s", {}), **{k: v[2] for k, v in bench.quantised.items()}},
                        weight_bytes={**kept.get("weight_bytes", {}), "fp16": _weight_bytes(bench.model),
                                      **{k: _weight_bytes(v[0]) for k, v in bench.quantised.items()}})
    meta["runs"] = kept.get("runs", []) + [{"date": meta["date"], "git_commit": meta["git_commit"]}]
    rows = summary(bench.kept_rows + bench.rows)
    (out / "decode-llm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "decode-llm.md").write_text(markdown(rows, meta))


def _weight_bytes(model) -> int:
    return sum(int(np.prod(t.dims)) * (2 if t.data_type == 10 else 4 if t.data_type == 1 else 1)
               for t in model.graph.initializer if len(t.dims) >= 1 and np.prod(t.dims) > 4096)


def markdown(rows: list[dict], meta: dict) -> str:
    c = meta["config"]
    lines = [f"# decode-llm", "",
             f"{meta.get('device', '?')}. One decode step of "
             f"{c['layers']} LLaMA-7B-width layers (hidden {c['hidden']}, MLP {c['intermediate']}, "
             f"{c['heads']} heads of 128, KV cache {c['past']}), random weights; device time by CUDA-graph "
             "replay; `vs compile` = device time / torch.compile fp16's at the same batch.", "",
             "| run | batch | weights | impl | device us | latency us | vs compile | kernels | max rel err (tol) |",
             "|---:|---:|---|---|---:|---:|---:|---:|---|"]
    runs = meta.get("runs") or [{"date": meta["date"], "git_commit": meta["git_commit"]}]
    for r in sorted(rows, key=lambda r: (r["batch"], r.get("run", 0))):
        name = VARIANTS.get(r["dtype"], (0, 0, "fp16"))[2]
        head = f"| {r.get('run', 0)} | {r['batch']} | {name} | {r['impl']} | "
        if r.get("device_time_s") is None:
            lines.append(head + f"- | - | - | - | {r.get('error', '')[:120]} |")
            continue
        err = r.get("max_rel_err")
        tol = f" ({r['tolerance']:.0e})" if r.get("tolerance") else ""
        lines.append(head + f"{r['device_time_s'] * 1e6:.1f} | "
                     f"{r['latency_s'] * 1e6:.1f} | {r.get('vs_compile', float('nan')):.3f} | {r.get('kernels', '-')} | "
                     f"{'-' if err is None else f'{err:.1e}'}{tol} |")
    wb = meta.get("weight_bytes", {})
    lines += ["", "Runs (ratios within a run): " + "; ".join(f"{i}: {r['date']}, commit {r['git_commit']}"
                                                        for i, r in enumerate(runs)) + ".",
              "Weight bytes per step: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in wb.items()) + "."]
    return "\n".join(lines) + "\n"


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def main(argv=None) -> int:
    from harness import torch_cuda_missing
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--past", type=int, default=1024)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default="int4,nf4,int2a8")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds; later rows are skipped past it")
    ap.add_argument("--steps", default="", help="explicit rows in order, e.g. 1:torch-compile,1:int4,16:fp16 "
                    "(fp16 = ours on the fp16 model); default: every batch and variant, the goal first")
    ap.add_argument("--keep", default=None, help="an earlier run's decode-llm.json whose rows stay in the result")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    if torch_cuda_missing("bench_decode_llm"):
        return 2
    steps = parse_steps(args.steps) if args.steps else plan([int(b) for b in args.batches.split(",")], variants)
    bench = Bench(args)
    execute(bench, steps)
    write(bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
