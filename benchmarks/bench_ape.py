"""Ape on the GPU: emulated fp32 GEMMs vs cuBLAS SGEMM and TF32, with error against float64.

    python benchmarks/bench_ape.py --out DIR [--quick]

Cases: square GEMMs 1024^3 .. 8192^3, the GEMMs of BERT-base (8 x 512 tokens) and of
ResNet-50 (batch 32, 3x3 / 1x1 convolutions as implicit GEMMs, and the classifier), each in
SGEMM, TF32, FP32-F, FP32-T, FP32-B (default engine: cuBLAS with the top level in the default
K chunks; and our own mma kernels) and auto; 8192^3 again with other chunks; the mixed
case (0-100 % of K panels that need FP32-B; pure FP32-B vs mixed vs what auto picks); auto
on data over the whole fp32 range; int16 from int8 vs an int32 CUDA-core GEMM.

Timing: each GEMM (split kernels and cuBLAS calls) is captured once into a CUDA graph and
the graph replayed between CUDA events; time per replay. Error: componentwise,
max |C - C64| / (|A| |B|) over C, with C64 and |A||B| from cuBLAS DGEMM; "in range" data is
N(0, 1) with |x| < 2^-12 moved to 2^-12 (inside every type's range).
Writes ape.json and ape.md to --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import subprocess
import time
import traceback
from pathlib import Path

import numpy as np

BERT = [("bert qkv", 4096, 2304, 768), ("bert attn-out", 4096, 768, 768), ("bert ffn1", 4096, 3072, 768),
        ("bert ffn2", 4096, 768, 3072)]
RESNET = [("resnet conv2 3x3", 100352, 64, 576), ("resnet conv3 3x3", 25088, 128, 1152),
          ("resnet conv4 3x3", 6272, 256, 2304), ("resnet conv5 3x3", 1568, 512, 4608),
          ("resnet conv2 1x1 up", 100352, 256, 64), ("resnet conv4 1x1 up", 6272, 1024, 256),
          ("resnet fc", 32, 1000, 2048)]
# an emulated mode with ":engine" runs on that engine (our own mma kernels); without, on the
# default engine (cuBLAS, top level in engine_choice.default_chunk's K chunks)
MODES = ("sgemm", "tf32", "fp32-f", "fp32-f:mma", "fp32-t", "fp32-t:mma", "fp32-b", "fp32-b:mma", "auto")


def time_graph(fn, stream, target_s: float = 0.08) -> float:
    """Seconds per replay of fn captured in a CUDA graph."""
    import cupy as cp
    with stream:
        fn()
        stream.synchronize()
        t0 = time.perf_counter()
        fn()
        stream.synchronize()
        once = time.perf_counter() - t0
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        graph.launch(stream)
        reps = max(3, min(200, math.ceil(target_s / max(once, 1e-6))))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def in_range_data(rng, shape):
    import cupy as cp
    x = rng.standard_normal(shape, dtype=np.float32)
    return cp.where(cp.abs(x) < 2.0 ** -12, cp.float32(2.0 ** -12), x).astype(cp.float32)


class Exact:
    """float64 product and sum(|A||B|) of one operand pair, for componentwise errors."""

    def __init__(self, a, b):
        import cupy as cp
        a64, b64 = a.astype(cp.float64), b.astype(cp.float64)
        self.c = a64 @ b64
        self.den = cp.abs(a64) @ cp.abs(b64)
        self.den[self.den == 0] = 1

    def error(self, c) -> float:
        import cupy as cp
        return float(cp.max(cp.abs(c.astype(cp.float64) - self.c) / self.den))


def baseline(kind: str, a, b, out):
    """cuBLAS SGEMM or TF32 GEMM as a callable (our binding, so graph-capturable)."""
    from powerfusion.ape import cublas
    m, k = a.shape
    n = b.shape[1]
    t = cublas.FP32 if kind == "sgemm" else cublas.TF32
    blas = cublas.handle_for(a.device.id)

    def run():
        import cupy as cp
        blas.bind(cp.cuda.get_current_stream())
        blas.gemm(t, m, n, k, cublas.Operand(a.data.ptr, k), cublas.Operand(b.data.ptr, n), cublas.Operand(out.data.ptr, n))
        return out
    return run


def gemm_for(mode: str, a, b, out, k_chunk=None, speeds=None):
    from powerfusion.ape.device import ApeGemm
    if mode in ("sgemm", "tf32"):
        return baseline(mode, a, b, out), None
    mode, _, engine = mode.partition(":")
    g = ApeGemm(a, b, mode, out, k_chunk=k_chunk, speeds=speeds, engine=engine or ("cublas" if k_chunk is not None else "auto"))
    return g.run, g


def chunk_label(g) -> str:
    """The K chunks of an emulated GEMM's groups ("-" where a group runs its top level whole)."""
    if g is None or not g.groups:
        return ""
    return "+".join(sorted({f"{grp.k_chunk} {grp.chunk_sum}" if grp.k_chunk else "-" for grp in g.groups}))


def measure(case, a, b, stream, modes=MODES, k_chunk=None, speeds=None, exact=None) -> list[dict]:
    import cupy as cp
    m, k = a.shape
    n = b.shape[1]
    exact = exact or Exact(a, b)
    out = cp.empty((m, n), cp.float32)
    rows = []
    for mode in modes:
        fn, g = gemm_for(mode, a, b, out, k_chunk, speeds)
        t = time_graph(fn, stream)
        with stream:
            fn()
        stream.synchronize()
        rows.append({"case": case, "m": m, "n": n, "k": k, "mode": mode, "k_chunk": k_chunk, "chunks": chunk_label(g),
                     "engine": "+".join(sorted({grp.engine for grp in g.groups})) if g and g.groups else "cublas",
                     "plan": g.plan.kind if g else mode, "time_s": t, "tflops": 2 * m * n * k / t / 1e12,
                     "error": exact.error(out),
                     "f_fraction_blocks": (g.plan.f_fraction_blocks if g and mode == "auto" else None)})
        del fn, g
    sg = next((r for r in rows if r["mode"] == "sgemm"), None)
    for r in rows:
        if sg:
            r["speedup_vs_sgemm"] = sg["time_s"] / r["time_s"]
            r["error_vs_sgemm"] = r["error"] / sg["error"] if sg["error"] else float("nan")
    return rows


def scan_time(a, b, stream) -> float:
    from powerfusion.ape.device import block_mask_device
    from powerfusion.ape.adapter import MASK_ROWS, PANEL

    masks = [block_mask_device(a, (MASK_ROWS, PANEL), copy=False), block_mask_device(b, (PANEL, MASK_ROWS), copy=False)]

    def scan():
        block_mask_device(a, (MASK_ROWS, PANEL), copy=False, mask=masks[0])
        block_mask_device(b, (PANEL, MASK_ROWS), copy=False, mask=masks[1])
    return time_graph(scan, stream)


def gemm_cases(rng, stream, quick: bool, log, square_only=False) -> list[dict]:
    rows = []
    sizes = [1024, 2048, 4096] + ([] if quick else [8192])
    cases = [(f"square {s}", s, s, s) for s in sizes] + ([] if square_only else BERT + RESNET)
    for name, m, n, k in cases:
        a, b = in_range_data(rng, (m, k)), in_range_data(rng, (k, n))
        new = measure(name, a, b, stream)
        scan = scan_time(a, b, stream)
        for r in new:
            r["scan_s"] = scan
        rows += new
        log(name, new)
    return rows


def chunk_cases(rng, stream, size: int, log) -> list[dict]:
    import cupy as cp
    a, b = in_range_data(rng, (size, size)), in_range_data(rng, (size, size))
    exact = Exact(a, b)
    rows = measure(f"square {size}", a, b, stream, modes=("sgemm",), exact=exact)
    for chunk in (0, 1024, 2048):
        new = measure(f"square {size}", a, b, stream, modes=("fp32-f", "fp32-t", "fp32-b"), k_chunk=chunk, exact=exact)
        for r in new:
            r["speedup_vs_sgemm"] = rows[0]["time_s"] / r["time_s"]
            r["error_vs_sgemm"] = r["error"] / rows[0]["error"]
        rows += new
        log(f"chunk {chunk or 'none'}", new)
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def breakdown(rng, stream, size: int, log) -> list[dict]:
    """The default engine at size^3: the split kernels and the GEMMs (with the chunk sums) timed apart."""
    import cupy as cp
    from powerfusion.ape.device import ApeGemm
    a, b = in_range_data(rng, (size, size)), in_range_data(rng, (size, size))
    out = cp.empty((size, size), cp.float32)
    rows = []
    for mode in ("fp32-f", "fp32-t", "fp32-b"):
        g = ApeGemm(a, b, mode, out)
        grp = g.groups[0]
        whole = time_graph(g.run, stream)
        splits = time_graph(lambda grp=grp: grp.split(a, b), stream)
        row = {"case": f"square {size}", "mode": mode, "engine": grp.engine, "chunks": chunk_label(g), "time_s": whole, "split_s": splits,
               "kernel_s": whole - splits, "kernel_tflops": 2 * size ** 3 * TYPES_PRODUCTS[mode] / (whole - splits) / 1e12}
        rows.append(row)
        log("breakdown", [row])
    return rows


TYPES_PRODUCTS = {"fp32-f": 3, "fp32-t": 3, "fp32-b": 6}


def mixed_curve(rng, stream, size: int, log) -> list[dict]:
    """K panels scaled into FP32-B's range (x 2^20): pure FP32-B, mixed, and auto."""
    import cupy as cp
    from powerfusion import ape
    from powerfusion.ape.adapter import PANEL
    npanels = size // PANEL
    rows = []
    force_mixed = ape.Speeds(f=1e-15, b=2e-15, fp32=1.0, launch=0.0)
    for pct in (0, 10, 25, 50, 75, 90, 100):
        a, b = in_range_data(rng, (size, size)), in_range_data(rng, (size, size))
        chosen = np.random.default_rng(pct).permutation(npanels)[: round(npanels * pct / 100)]
        for p in chosen.tolist():
            a[:, p * PANEL:(p + 1) * PANEL] *= cp.float32(2.0 ** 20)
        exact = Exact(a, b)
        new = measure(f"mixed {pct}%", a, b, stream, modes=("sgemm", "fp32-b", "auto"), exact=exact)
        if 0 < pct < 100:
            mixed = measure(f"mixed {pct}%", a, b, stream, modes=("auto",), speeds=force_mixed, exact=exact)[0]
            mixed["mode"] = "mixed (forced)"
            mixed["speedup_vs_sgemm"] = new[0]["time_s"] / mixed["time_s"]
            new.append(mixed)
        for r in new:
            r["b_panel_pct"] = pct
        rows += new
        log(f"mixed {pct}%", new)
        del a, b, exact
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def full_range_case(rng, stream, size: int, log) -> list[dict]:
    """Auto on data over the whole fp32 range: panels needing FP32-B, panels of tiny values
    (fp32 only), the rest FP32-F; compared with SGEMM's error on the same data."""
    import cupy as cp
    from powerfusion.ape.adapter import PANEL
    a, b = in_range_data(rng, (size, size)), in_range_data(rng, (size, size))
    a[:, 3 * PANEL:5 * PANEL] *= cp.float32(2.0 ** 30)
    b[9 * PANEL:10 * PANEL] *= cp.float32(2.0 ** -90)
    a[:, 17 * PANEL:18 * PANEL] *= cp.float32(2.0 ** -120)
    rows = measure(f"full range {size}", a, b, stream, modes=("sgemm", "tf32", "fp32-f", "fp32-t", "fp32-b", "auto"))
    log("full range", rows)
    return rows


def int16_cases(rng, stream, sizes, log) -> list[dict]:
    import cupy as cp
    from powerfusion.ape.device import Int16Gemm
    rows, host_rng = [], np.random.default_rng(16)
    for s in sizes:
        a = cp.asarray(host_rng.integers(-32768, 32768, (s, s)).astype(np.int16))
        b = cp.asarray(host_rng.integers(-32768, 32768, (s, s)).astype(np.int16))
        g = Int16Gemm(a, b)
        t_ape = time_graph(g.run, stream)
        with stream:
            g.run()
        a32, b32 = a.astype(cp.int32), b.astype(cp.int32)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        if s <= 1024:  # compiles CuPy's integer matmul kernel (CUDA cores, wrapping int32 accumulation)
            cp.matmul(a32, b32)
        start.record()
        ref = cp.matmul(a32, b32)
        stop.record()
        stop.synchronize()
        t_i32 = cp.cuda.get_elapsed_time(start, stop) / 1e3
        stream.synchronize()
        exact = bool(cp.array_equal(g.out, ref))
        if s <= 1024:
            exact = exact and bool(np.array_equal(cp.asnumpy(g.out), (cp.asnumpy(a).astype(np.int64)
                                                                      @ cp.asnumpy(b).astype(np.int64)).astype(np.int32)))
        row = {"case": f"int16 {s}", "m": s, "n": s, "k": s, "time_ape_s": t_ape, "time_int32_s": t_i32,
               "speedup": t_i32 / t_ape, "bit_exact": exact, "tops": 2 * s ** 3 / t_ape / 1e12}
        rows.append(row)
        log(row["case"], [row])
        if t_i32 > 2.0:
            break
    return rows


def markdown(meta, res) -> str:
    lines = [f"# Ape GEMMs ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             "Time per call from CUDA-graph replay (split kernels + cuBLAS calls, or our mma kernel where mode:mma says so; chunks: K per GEMM of the top level and how the chunks reach C); error = max over C of "
             "|C - C64| / (|A||B|) against float64; speedup and error ratio vs cuBLAS SGEMM on the same data.", "",
             "| case | M x N x K | mode | plan (engine) | time (ms) | TFLOP/s | speedup vs SGEMM | error | error / SGEMM's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("gemm", []) + res.get("chunks", []) + res.get("full_range", []):
        mode = r["mode"] + (f" (K chunk {r['k_chunk'] or 'none'})" if r.get("k_chunk") is not None else "")
        chunks = f", chunks {r['chunks']}" if r.get("chunks") and r.get("engine") == "cublas" else ""
        lines.append(f"| {r['case']} | {r['m']}x{r['n']}x{r['k']} | {mode} | {r['plan']} ({r.get('engine', 'cublas')}{chunks}) | {r['time_s'] * 1e3:.3f} | "
                     f"{r['tflops']:.1f} | {r.get('speedup_vs_sgemm', float('nan')):.2f}x | {r['error']:.2e} | "
                     f"{r.get('error_vs_sgemm', float('nan')):.2f} |")
    if res.get("breakdown"):
        lines += ["", "## Default engine: split kernels vs GEMMs", "",
                  "| case | mode | engine, chunks | total (ms) | splits (ms) | GEMMs (ms) | GEMM TFLOP/s of part products |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["breakdown"]:
            lines.append(f"| {r['case']} | {r['mode']} | {r.get('engine', 'mma')}, {r.get('chunks', '')} | {r['time_s'] * 1e3:.3f} | {r['split_s'] * 1e3:.3f} | "
                         f"{r['kernel_s'] * 1e3:.3f} | {r['kernel_tflops']:.0f} |")
    lines += ["", "## Mixed case (share of K panels needing FP32-B)", "",
              "| FP32-B panels | SGEMM (ms) | pure FP32-B (ms) | mixed (ms) | auto (ms) | auto's plan | auto error / SGEMM's |",
              "|---|---|---|---|---|---|---|"]
    by_pct = {}
    for r in res.get("mixed", []):
        by_pct.setdefault(r["b_panel_pct"], {})[r["mode"]] = r
    for pct, d in sorted(by_pct.items()):
        if not {"sgemm", "fp32-b", "auto"} <= set(d):
            continue
        mixed = d.get("mixed (forced)")
        lines.append(f"| {pct}% | {d['sgemm']['time_s'] * 1e3:.2f} | {d['fp32-b']['time_s'] * 1e3:.2f} | "
                     f"{mixed['time_s'] * 1e3 if mixed else float('nan'):.2f} | {d['auto']['time_s'] * 1e3:.2f} | "
                     f"{d['auto']['plan']} | {d['auto']['error_vs_sgemm']:.2f} |")
    lines += ["", "## Scan (block masks of A and B) vs the GEMM", "", "| case | scan (us) | auto GEMM (ms) | share |",
              "|---|---|---|---|"]
    for r in res.get("gemm", []):
        if r["mode"] == "auto":
            lines.append(f"| {r['case']} | {r['scan_s'] * 1e6:.1f} | {r['time_s'] * 1e3:.3f} | {r['scan_s'] / r['time_s']:.1%} |")
    lines += ["", "## int16 from int8 (vs CuPy's int32 CUDA-core matmul)", "",
              "| case | Ape int16 (ms) | int32 CUDA cores (ms) | speedup | bit-exact |", "|---|---|---|---|---|"]
    for r in res.get("int16", []):
        lines.append(f"| {r['case']} | {r['time_ape_s'] * 1e3:.2f} | {r['time_int32_s'] * 1e3:.2f} | "
                     f"{r['speedup']:.1f}x | {r['bit_exact']} |")
    for name, tb in res.get("failures", {}).items():
        lines += ["", f"Section {name} failed: {tb.strip().splitlines()[-1]}"]
    return "\n".join(lines) + "\n"


def main():
    import cupy as cp
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="no 8192 cases (for a smoke run)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse here)")
    ap.add_argument("--sections", default="gemm,breakdown,chunks,full_range,mixed,int16",
                    help="comma-separated sections to run")
    ap.add_argument("--square-only", action="store_true", help="gemm section: square sizes only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = cp.random.default_rng(19)
    stream = cp.cuda.Stream(non_blocking=True)
    t0 = time.time()

    def log(name, rows):
        for r in rows:
            keys = ("mode", "engine", "chunks", "plan", "time_s", "split_s", "kernel_s", "kernel_tflops", "speedup_vs_sgemm", "error", "error_vs_sgemm", "speedup", "bit_exact")
            print(f"[{time.time() - t0:6.1f}s] {name}: " + ", ".join(f"{k}={r[k]:.4g}" if isinstance(r.get(k), float)
                                                                    else f"{k}={r[k]}" for k in keys if k in r), flush=True)

    big = 4096 if args.quick else 8192
    sections = {"gemm": lambda: gemm_cases(rng, stream, args.quick, log, args.square_only),
                "breakdown": lambda: breakdown(rng, stream, big, log),
                "chunks": lambda: chunk_cases(rng, stream, big, log),
                "full_range": lambda: full_range_case(rng, stream, 4096, log),
                "mixed": lambda: mixed_curve(rng, stream, big, log),
                "int16": lambda: int16_cases(rng, stream, (1024, 4096, 8192), log)}
    res, failures = {}, {}
    wanted = args.sections.split(",")
    props = cp.cuda.runtime.getDeviceProperties(0)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    meta = {"device": props["name"].decode(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "cupy": cp.__version__}
    res, failures = {"failures": {}}, {}
    for name, fn in sections.items():
        if name not in wanted:
            continue
        try:
            res[name] = fn()
        except Exception:  # report the section that failed and keep the others
            failures[name] = traceback.format_exc()
            print(failures[name], flush=True)
            res[name] = []
        cp.get_default_memory_pool().free_all_blocks()
        res["failures"] = failures
        # written after every section, so a run cut short keeps what it measured
        (args.out / "ape.json").write_text(json.dumps({"meta": meta, **res}, indent=1))
        (args.out / "ape.md").write_text(markdown(meta, res))
    print(markdown(meta, res))

if __name__ == "__main__":
    main()
