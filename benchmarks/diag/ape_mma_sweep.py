"""Ape engine "mma" vs "cublas" at square sizes, with the split kernels and our tensor-core
kernel timed apart and ring depths / tile groupings of the kernel compared (tuning aid).

    python benchmarks/diag/ape_mma_sweep.py --out DIR [--sizes 4096,8192] [--modes fp32-f,fp32-t,fp32-b]

Writes ape-mma-sweep.json to --out; prints one line per measurement."""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_ape import Exact, baseline, in_range_data, time_graph

PRODUCTS = {"fp32-f": 3, "fp32-t": 3, "fp32-b": 6}
# (n8 tiles per warp or None for the mode's default, ring depth, blocks per SM, tile grouping,
# k-tile); the defaults are mma.TILINGS, group 8, k-tile 32
VARIANTS = [(None, 2, 1, 8, 32), (None, 4, 1, 8, 32), (None, 3, 1, 16, 32), (None, 2, 1, 8, 64), (4, 4, 1, 8, 32),
            (8, 2, 1, 8, 32), (4, 2, 2, 8, 32), (4, 3, 2, 8, 32)]


def variant(mode, wn, stages, minb, group_m, bk):
    import cupy as cp

    from powerfusion.ape import mma
    tiling = mma.Tiling(wn or mma.TILINGS[mode].wn, stages, minb)
    smem = mma.smem_bytes(mode, tiling, bk)
    if smem * minb > 227 * 1024:
        return None
    fn = cp.RawModule(code=mma.source({mode: tiling}, group_m, bk, (mode,))).get_function(f"ape_mma_{mode[-1]}")
    fn.max_dynamic_shared_size_bytes = smem
    return fn, tiling, smem


def bound(fn, *args, **kw):
    """fn with its arguments fixed now (a loop's variables would be read at call time)."""
    return lambda: fn(*args, **kw)


def main():
    import cupy as cp

    from powerfusion.ape import mma
    from powerfusion.ape.device import ApeGemm
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--modes", default="fp32-f,fp32-t,fp32-b")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = cp.random.default_rng(19)
    stream = cp.cuda.Stream(non_blocking=True)
    rows, t0 = [], time.time()

    def log(row):
        rows.append(row)
        print(f"[{time.time() - t0:6.1f}s] " + json.dumps(row), flush=True)

    for size in [int(s) for s in args.sizes.split(",")]:
        a, b = in_range_data(rng, (size, size)), in_range_data(rng, (size, size))
        exact = Exact(a, b)
        out = cp.empty((size, size), cp.float32)
        t_sg = time_graph(baseline("sgemm", a, b, out), stream)
        with stream:
            baseline("sgemm", a, b, out)()
        stream.synchronize()
        e_sg = exact.error(out)
        log({"size": size, "mode": "sgemm", "time_ms": t_sg * 1e3, "error": e_sg})
        for mode in args.modes.split(","):
            for engine, chunk in (("mma", None), ("cublas", None), ("cublas", 4096)):
                try:
                    g = ApeGemm(a, b, mode, out, engine=engine, k_chunk=chunk)
                    t = time_graph(g.run, stream)
                    with stream:
                        g.run()
                    stream.synchronize()
                    e = exact.error(out)
                    row = {"size": size, "mode": mode, "engine": g.groups[0].engine, "k_chunk": chunk, "time_ms": t * 1e3,
                           "speedup": t_sg / t, "error": e, "error_vs_sgemm": e / e_sg}
                    if engine == "mma":
                        grp = g.groups[0]
                        split = time_graph(bound(grp.split, a, b), stream)
                        row.update(split_ms=split * 1e3, kernel_tflops=2 * size ** 3 * PRODUCTS[mode] / (t - split) / 1e12)
                    log(row)
                    if engine == "mma":
                        for wn, stages, minb, group_m, bk in VARIANTS:
                            name = (f"wn {wn or mma.TILINGS[mode].wn}, stages {stages}, blocks/SM {minb}, "
                                    f"group_m {group_m}, bk {bk}")
                            try:
                                made = variant(mode, wn, stages, minb, group_m, bk)
                                if made is None:
                                    continue
                                fn, tiling, smem = made
                                args_ = (grp.a_parts, grp.b_parts, np.int64(size), np.int64(size), np.int64(grp.kp), out,
                                         np.int32(0))
                                launch = bound(fn, (mma.grid(size, size, mode, tiling),), (mma.THREADS,), args_,
                                               shared_mem=smem)
                                tk = time_graph(launch, stream)
                                log({"size": size, "mode": mode, "variant": name, "kernel_ms": tk * 1e3,
                                     "kernel_tflops": 2 * size ** 3 * PRODUCTS[mode] / tk / 1e12, "error": exact.error(out)})
                            except Exception:   # noqa: BLE001 -- keep the other variants
                                log({"size": size, "mode": mode, "variant": name, "failed": traceback.format_exc()[-800:]})
                except Exception:   # noqa: BLE001 -- keep the other measurements
                    log({"size": size, "mode": mode, "engine": engine, "failed": traceback.format_exc()})
        del a, b, exact, out
        cp.get_default_memory_pool().free_all_blocks()
    (args.out / "ape-mma-sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
