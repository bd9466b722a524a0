"""Ape's cuBLAS engine: how the tensor cores sum a GEMM, and what K chunks of the top level
cost and buy (tuning aid for `engine_choice.default_chunk`).

    python benchmarks/diag/ape_chunk_sweep.py --out DIR [--sections probe,big,shapes]

probe: raw cuBLAS fp16 / bf16 / TF32 GEMMs (64 x 64 outputs, fp32 accumulation) on seeded
inputs exact in the part type, K 256 ... 8192, normal and positive data; the outputs go to
ape-tc-probe.npz so `accumulation.tc_matmul` can be compared with the device bit for bit
(inputs regenerate from the seeds; their sums are stored to check that they did).
big: 8192^3, FP32-F / T / B, top level unchunked or in chunks of 1024 / 2048 / 4096 (beta = 1
chain or strided-batched + sum kernel). shapes: the BERT-base GEMMs, some ResNet-50 convs as
GEMMs and squares 1024 ... 4096, chunks 0 / 256 / 512 / default, and the mma engine.
Writes ape-chunk-sweep.json; prints one line per measurement."""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_ape import BERT, Exact, baseline, in_range_data, time_graph

PROBE_K = (256, 2048, 8192)
PROBE_MN = 64
PROBE_TYPES = ("float16", "bfloat16", "tf32")
SHAPES = BERT + [("resnet conv4 3x3", 6272, 256, 2304), ("resnet conv5 3x3", 1568, 512, 4608),
                 ("resnet conv4 1x1 up", 6272, 1024, 256), ("square 1024", 1024, 1024, 1024),
                 ("square 2048", 2048, 2048, 2048), ("square 4096", 4096, 4096, 4096)]


def probe_inputs(part: str, data: str, k: int):
    """Seeded inputs exactly representable in the part type (fp32 arrays)."""
    import ml_dtypes

    from powerfusion.ape.types import _tf32_round
    rng = np.random.default_rng([PROBE_TYPES.index(part), ("normal", "positive").index(data), k])
    draw = (lambda s: rng.standard_normal(s)) if data == "normal" else (lambda s: rng.uniform(0.5, 2.0, s))
    a, b = draw((PROBE_MN, k)).astype(np.float32), draw((k, PROBE_MN)).astype(np.float32)
    if part == "tf32":
        return _tf32_round(a), _tf32_round(b)
    dt = np.float16 if part == "float16" else ml_dtypes.bfloat16
    return a.astype(dt).astype(np.float32), b.astype(dt).astype(np.float32)


def probe(log) -> dict:
    import cupy as cp

    from powerfusion.ape import cublas
    blas = cublas.handle_for(0)
    blas.bind(cp.cuda.get_current_stream())
    gt = {"float16": (cublas.FP16, np.float16), "bfloat16": (cublas.BF16, None), "tf32": (cublas.TF32, np.float32)}
    out = {}
    for part in PROBE_TYPES:
        for data in ("normal", "positive"):
            for k in PROBE_K:
                a, b = probe_inputs(part, data, k)
                t, store = gt[part]
                if store is None:   # bf16 bits: the top half of the fp32 word (exact: a is bf16)
                    da = cp.asarray((a.view(np.uint32) >> 16).astype(np.uint16))
                    db = cp.asarray((b.view(np.uint32) >> 16).astype(np.uint16))
                else:
                    da, db = cp.asarray(a.astype(store)), cp.asarray(b.astype(store))
                c = cp.empty((PROBE_MN, PROBE_MN), cp.float32)
                blas.gemm(t, PROBE_MN, PROBE_MN, k, cublas.Operand(da.data.ptr, k), cublas.Operand(db.data.ptr, PROBE_MN),
                          cublas.Operand(c.data.ptr, PROBE_MN))
                key = f"{part}_{data}_{k}"
                out[key] = cp.asnumpy(c)
                out[key + "_sum"] = np.array([a.astype(np.float64).sum(), b.astype(np.float64).sum()])
                exact = a.astype(np.float64) @ b.astype(np.float64)
                err = float(np.max(np.abs(out[key] - exact) / (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))))
                signed = float(np.mean((out[key] - exact) / np.abs(exact).clip(1e-30)))
                log("probe", {"key": key, "error": err, "mean_rel_signed": signed})
    from powerfusion.ape.device import ApeGemm
    for k in (1024, 8192):   # whole cuBLAS-engine plans on fp32 data, for the plan models
        rng = np.random.default_rng([7, k])
        a = rng.standard_normal((PROBE_MN, k)).astype(np.float32)
        b = rng.standard_normal((k, PROBE_MN)).astype(np.float32)
        out[f"plan_inputs_{k}_sum"] = np.array([a.astype(np.float64).sum(), b.astype(np.float64).sum()])
        for mode in ("fp32-f", "fp32-t", "fp32-b"):
            for chunk in (0, 256):
                g = ApeGemm(cp.asarray(a), cp.asarray(b), mode, engine="cublas", k_chunk=chunk)
                out[f"plan_{mode}_{k}_{chunk}"] = cp.asnumpy(g.run())
    return out


def sweep(shapes, configs, log) -> list[dict]:
    import cupy as cp

    from powerfusion.ape.device import ApeGemm
    rng = cp.random.default_rng(19)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for name, m, n, k in shapes:
        a, b = in_range_data(rng, (m, k)), in_range_data(rng, (k, n))
        exact = Exact(a, b)
        out = cp.empty((m, n), cp.float32)
        sg = baseline("sgemm", a, b, out)
        t_sg = time_graph(sg, stream)
        with stream:
            sg()
        stream.synchronize()
        e_sg = exact.error(out)
        log(name, {"mode": "sgemm", "time_s": t_sg, "error": e_sg})
        for mode, engine, chunk, how in configs:
            g = None
            try:
                g = ApeGemm(a, b, mode, out, engine=engine, k_chunk=chunk, chunk_sum=how)
                t = time_graph(g.run, stream)
                with stream:
                    g.run()
                stream.synchronize()
                grp = g.groups[0] if g.groups else None
                row = {"case": name, "m": m, "n": n, "k": k, "mode": mode, "engine": engine, "k_chunk_asked": chunk,
                       "k_chunk": grp.k_chunk if grp else None, "chunk_sum": grp.chunk_sum if grp else None,
                       "plan": g.plan.kind, "time_s": t, "speedup": t_sg / t, "error": exact.error(out),
                       "sgemm_s": t_sg, "sgemm_error": e_sg}
                row["error_ratio"] = row["error"] / e_sg
            except Exception:
                row = {"case": name, "mode": mode, "engine": engine, "k_chunk_asked": chunk, "failed": traceback.format_exc()}
            rows.append(row)
            log(name, row)
            del g
            cp.get_default_memory_pool().free_all_blocks()
        del a, b, exact, out
        cp.get_default_memory_pool().free_all_blocks()
    return rows


BIG_CONFIGS = [(mode, "cublas", chunk, how) for mode in ("fp32-f", "fp32-t", "fp32-b")
               for chunk, how in ((0, "beta"), (1024, "beta"), (2048, "beta"), (4096, "beta"), (1024, "batched"),
                                  (2048, "batched"))]
SHAPE_CONFIGS = [(mode, "cublas", chunk, how) for mode in ("fp32-f", "fp32-t", "fp32-b")
                 for chunk, how in ((0, "beta"), (256, "beta"), (512, "beta"), (None, "beta"), (256, "batched"),
                                    (None, "batched"))] + \
                [(mode, "mma", None, "beta") for mode in ("fp32-f", "fp32-t", "fp32-b")] + [("auto", "auto", None, "beta")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sections", default="probe,big,shapes")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(name, row):
        print(f"[{time.time() - t0:6.1f}s] {name}: " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            if k not in ("failed",)) + (("\n" + row["failed"]) if "failed" in row else ""), flush=True)

    res = {}
    for name in args.sections.split(","):
        try:
            if name == "probe":
                np.savez(args.out / "ape-tc-probe.npz", **probe(log))
            elif name == "big":
                res["big"] = sweep([("square 8192", 8192, 8192, 8192)], BIG_CONFIGS, log)
            elif name == "shapes":
                res["shapes"] = sweep(SHAPES, SHAPE_CONFIGS, log)
        except Exception:
            res[f"{name}_failed"] = traceback.format_exc()
            print(res[f"{name}_failed"], flush=True)
        (args.out / "ape-chunk-sweep.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
