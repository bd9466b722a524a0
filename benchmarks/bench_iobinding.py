"""Per-call overhead of IO binding on CUDA: run_with_iobinding with CuPy inputs and bound CuPy
outputs, against the device time of the same session's CUDA-graph replay.

    PYTHONPATH=$PWD python3 benchmarks/bench_iobinding.py [--models sardrn_small,resnet_small] [--calls 2000]

Per model: device time (back-to-back graph replays between CUDA events, median per replay), the wall time of
one `sess.run_with_iobinding(binding)` (median of --calls, each synchronised, as the call itself
synchronises) and of one `sess.run(None, numpy feeds)`; overhead = binding call - device time.
After the 20 warm-up calls the binding runs on a graph of its own buffers (backends/cuda/bound.py;
benchmarks/diag/iobinding_profile.py times the other paths and the CUDA calls one bound call makes).
The issue's target is overhead <= 20 us. Writes benchmarks/results/iobinding-overhead.json/.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TARGET_US = 20.0
PROFILE = False


def measure(name: str, calls: int) -> dict:
    import cupy
    import numpy as np
    import powerfusion as pf
    from bench_models import graph_replay_times
    sess = pf.InferenceSession(pf.demo_model(name), providers=["CUDAExecutionProvider"],
                               options={"cuda_graph": True})
    rng = np.random.default_rng(0)
    host = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in sess.get_inputs()}
    dev_in = {k: cupy.asarray(v) for k, v in host.items()}
    dev_out = {o.name: cupy.empty(o.shape, np.float32) for o in sess.get_outputs()}
    binding = sess.io_binding()
    for k, v in dev_in.items():
        binding.bind_input(k, "cuda", 0, np.float32, v.shape, v.data.ptr)
    for k, v in dev_out.items():
        binding.bind_output(k, "cuda", 0, np.float32, v.shape, v.data.ptr)
    for _ in range(20):
        sess.run_with_iobinding(binding)
    device = [t * 1e6 for t in graph_replay_times(sess, repeats=max(calls // 20, 10))]
    bound, plain = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        bound.append((time.perf_counter() - t0) * 1e6)
    for _ in range(max(calls // 10, 20)):
        t0 = time.perf_counter()
        sess.run(None, host)
        plain.append((time.perf_counter() - t0) * 1e6)
    if PROFILE:   # where the host time of a bound call goes (printed; not recorded)
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            sess.run_with_iobinding(binding)
        prof.disable()
        print(f"---- {name}: cProfile of 500 run_with_iobinding calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    dev_us, bound_us = statistics.median(device), statistics.median(bound)
    return {"model": name, "device_us": round(dev_us, 2), "iobinding_call_us": round(bound_us, 2),
            "overhead_us": round(bound_us - dev_us, 2), "run_numpy_us": round(statistics.median(plain), 2),
            "calls": calls, "within_target": bound_us - dev_us <= TARGET_US}


def main(argv=None) -> int:
    from benchmarks.harness import run_metadata
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="sardrn_small,resnet_small,shufflenet_small")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the bound calls per model")
    args = ap.parse_args(argv)
    global PROFILE
    PROFILE = args.profile
    rows = [measure(m, args.calls) for m in args.models.split(",")]
    meta = run_metadata(target_overhead_us=TARGET_US)
    try:
        from powerfusion.backends.cuda.runtime import device_info
        meta["device"] = device_info().name
    except Exception:
        pass
    out = ROOT / "benchmarks" / "results" / "iobinding-overhead"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# IO-binding overhead (CUDA, cuda_graph=True)", "",
             f"{meta.get('device', '?')}, {meta['date']}, commit {meta['git_commit']}; medians of {args.calls} calls; "
             f"target: overhead <= {TARGET_US:g} us.", "",
             "| model | device us | run_with_iobinding us | overhead us | run(numpy) us |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['device_us']} | {r['iobinding_call_us']} | {r['overhead_us']} | {r['run_numpy_us']} |"
              for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
