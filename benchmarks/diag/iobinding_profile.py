"""Where the host time of a bound `run_with_iobinding` call goes (CUDA, cuda_graph=True).

    PYTHONPATH=$PWD python3 benchmarks/diag/iobinding_profile.py [--models sardrn_small] [--calls 1000]

Per model, medians in microseconds: device time (back-to-back graph replays); one bound call
on each path -- the prepared binding with a graph of its own (reads and writes the bound
buffers in place), the prepared binding copying through the arena, and `run_bound` (checks
and prepares at every call, as every call did before bindings were prepared); the CUDA calls
a bound call cannot avoid, each timed alone (cudaGetDevice, current stream, one
device-to-device cudaMemcpyAsync of the input, a graph launch, a synchronisation of an idle
stream, launch + synchronise of the captured graph); a cProfile of the prepared calls; and
the largest difference between the binding's own graph and `run`.
Prints only; benchmarks/bench_iobinding.py records the overhead.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 2)


def _binding(sess, dev_in, dev_out):
    import numpy as np
    binding = sess.io_binding()
    for k, v in dev_in.items():
        binding.bind_input(k, "cuda", 0, np.float32, v.shape, v.data.ptr)
    for k, v in dev_out.items():
        binding.bind_output(k, "cuda", 0, np.float32, v.shape, v.data.ptr)
    return binding


def profile(name: str, calls: int) -> None:
    import cupy
    import numpy as np
    import powerfusion as pf
    from bench_models import graph_replay_times
    from powerfusion.backends.cuda import bound
    sess = pf.InferenceSession(pf.demo_model(name), providers=["CUDAExecutionProvider"],
                               options={"cuda_graph": True})
    runner = sess._executor
    rng = np.random.default_rng(0)
    host = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in sess.get_inputs()}
    dev_in = {k: cupy.asarray(v) for k, v in host.items()}
    dev_out = {o.name: cupy.empty(o.shape, np.float32) for o in sess.get_outputs()}
    direct = _binding(sess, dev_in, dev_out)
    for _ in range(20):
        sess.run_with_iobinding(direct)
    row = {"pieces": [k for k, _ in runner._cuda_graph], "fault_checks": len(runner.fault_checks()),
           "bound_graphs": len(runner._bound_graphs)}
    row["device"] = round(statistics.median(t * 1e6 for t in graph_replay_times(sess, repeats=50)), 2)
    row["prepared, own graph"] = _median_us(lambda: sess.run_with_iobinding(direct), calls)
    saved, bound.DIRECT_AFTER = bound.DIRECT_AFTER, 10 ** 9
    copying = _binding(sess, dev_in, dev_out)
    for _ in range(20):
        sess.run_with_iobinding(copying)
    row["prepared, copies"] = _median_us(lambda: sess.run_with_iobinding(copying), calls)
    feeds = dict(dev_in)
    wanted = {k: ("cuda", v) for k, v in dev_out.items()}
    row["run_bound each call"] = _median_us(lambda: sess.run_bound(feeds, wanted), calls // 2)
    stream = cupy.cuda.get_current_stream()
    src = next(iter(dev_in.values()))
    dst = cupy.empty_like(src)
    row["cudaGetDevice"] = _median_us(cupy.cuda.runtime.getDevice, calls)
    row["get_current_stream"] = _median_us(cupy.cuda.get_current_stream, calls)
    row["memcpyAsync issue"] = _median_us(lambda: cupy.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, src.nbytes, bound.D2D, stream.ptr), calls)
    stream.synchronize()
    graph = runner._cuda_graph[0][1]
    row["graph launch issue"] = _median_us(lambda: graph.launch(stream), 50)
    stream.synchronize()
    row["idle synchronize"] = _median_us(stream.synchronize, calls)
    row["launch + synchronize"] = _median_us(lambda: (graph.launch(stream), stream.synchronize()), calls)
    row["with Device()"] = _median_us(lambda: cupy.cuda.Device(0).__enter__().__exit__(None, None, None), calls)
    print(f"---- {name}: " + ", ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        sess.run_with_iobinding(copying)
    prof.disable()
    print(f"---- {name}: cProfile of 500 prepared calls (copies through the arena)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    bound.DIRECT_AFTER = saved
    want = sess.run(None, host)    # the bound graph computes what the session's own graph does
    sess.run_with_iobinding(direct)
    diff = max(float(np.abs(cupy.asnumpy(dev_out[o.name]) - w).max()) for o, w in zip(sess.get_outputs(), want))
    print(f"---- {name}: own graph vs run(): max abs difference {diff:g}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="sardrn_small,resnet_small,shufflenet_small")
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args(argv)
    for m in args.models.split(","):
        profile(m, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
