"""Warm torch.compile's on-disk caches (Inductor FX graph cache, Triton kernels) for every
benchmark case, in parallel processes, so the timing run that follows spends its device
minutes timing rather than compiling. Each process compiles its share of the cases and
calls each once; nothing here is timed.

    PYTHONPATH=$PWD python3 benchmarks/warm_torch_compile.py --suites norms subgraphs [--jobs 12]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


BIG = 4 << 30   # bytes: cases this large are warmed one at a time (by worker 0), to bound GPU memory


def _cases(suites, dtypes=None):
    import gir_cases
    cases = gir_cases.cases_for([s for s in suites if s != "models"])
    return [c for c in cases if not dtypes or c.dtype in dtypes]


def _warm(args) -> str:
    suites, k, jobs, dtypes = args
    import torch
    from baselines import torch_impls
    from bench_gir import make_inputs
    done = []
    small = [c for c in _cases(suites, dtypes) if c.bytes <= BIG]
    mine = [c for c in _cases(suites, dtypes) if c.bytes > BIG] if k == 0 else \
        [c for n, c in enumerate(small) if n % max(1, jobs - 1) == k - 1]
    if jobs == 1:
        mine = _cases(suites, dtypes)
    for case in mine:
        t0 = time.perf_counter()
        try:
            fn = torch_impls(case.torch_fn)["torch-compile"]
            fn(*make_inputs(case, 0))
            torch.cuda.synchronize()
            done.append(f"{case.name}-{case.dtype} {time.perf_counter() - t0:.1f}s")
        except Exception as e:  # the timing run reports the failure properly
            done.append(f"{case.name}-{case.dtype} failed: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.empty_cache()
    return "\n".join(done)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suites", nargs="+", default=["norms", "subgraphs"])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--dtypes", nargs="+", default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for out in pool.imap_unordered(_warm, [(args.suites, k, args.jobs, args.dtypes) for k in range(args.jobs)]):
            print(out, flush=True)
    print(f"warmed in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
