"""ttile-prefill.json -> ttile-prefill.md: per M the geomean speedup over cuBLAS fp16 of each type's
default, W4A16 per shape (default, best candidate tile, the paths that ran before), the targets.

    python benchmarks/ttile/summarize_prefill.py OUT/ttile-prefill.json   (writes OUT/ttile-prefill.md)
"""
from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize import errors, main

TARGETS = {16: 1.5, 256: 1.0}   # 4-bit weights, geomean over the shapes


def _geo(v):
    return math.prod(v) ** (1 / len(v)) if v else float("nan")


def _key(r):
    return f"{r['A']} x {r['W']}" + (f"/{r['zeros']}" if r.get("zeros") else "")


def render(data) -> str:
    meta, rows = data["meta"], [r for r in data["rows"] if "time_us" in r]
    shapes = sorted({(r["N"], r["K"]) for r in rows})
    ms = sorted({r["M"] for r in rows})
    lines = [f"# Typed GEMM at prefill sizes ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             f"Timing: {meta['method']}; copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s "
             f"({meta['copy_bandwidth_by']}). Speedup: cuBLAS fp16 time / ours, same run. Group 128. "
             "Default: the scheduler's kernel (M = 1: CUDA-core GEMV; 16 <= M: the tensor-core prefill kernel "
             "with its M bucket's tile). Before: the per-tile mma kernel or dequantise + cuBLAS, "
             "whichever is faster per shape (what the scheduler chose from before the prefill kernel).", ""]
    if meta.get("incomplete"):
        lines += [f"**Incomplete run:** {meta['incomplete']}.", ""]
    for k, v in meta.get("notes", {}).items():
        lines += [f"**{k}:** {v}.", ""]
    geo = defaultdict(lambda: defaultdict(list))
    cell = {}
    for r in rows:
        cell[(r["M"], r["N"], r["K"], _key(r), r["config"])] = r
        if r["config"] == "default" and r["kernel"] != "cublas_fp16":
            geo[_key(r)][r["M"]].append(r["speedup"])
    lines += ["## Geomean speedup over cuBLAS fp16 (default)", "",
              "| A x W | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
    for k in sorted(geo):
        lines.append(f"| {k} | " + " | ".join(f"{_geo(geo[k][m]):.2f}x" if geo[k][m] else "-" for m in ms) + " |")
    for name in ("fp16 x int4", "fp16 x nf4"):
        before = defaultdict(list)
        for m in ms:
            for n, k in shapes:
                b = [cell[c] for c in ((m, n, k, name, "before: mma"), (m, n, k, name, "before: dequant")) if c in cell]
                if b:
                    before[m].append(max(x["speedup"] for x in b))
        if before:
            lines += ["", f"{name} before the prefill kernel (best of mma / dequant + cuBLAS): " + ", ".join(
                f"M={m} {_geo(v):.2f}x" for m, v in sorted(before.items())) + "."]
    bw = meta["copy_bandwidth_GBps"] * 1e9
    floor = defaultdict(list)   # no fp16 GEMM beats reading its fp16 weights once at copy bandwidth
    for r in rows:
        if r["config"] == "default" and _key(r) == "fp16 x int4":
            floor[r["M"]].append(r["N"] * r["K"] * 2 / bw * 1e6 / r["time_us"])
    lines += ["", "fp16 x int4 against the fp16 weight-read floor (N K 2 bytes / copy bandwidth: a lower bound "
              "on the speedup over any fp16 GEMM): " + ", ".join(f"M={m} {_geo(v):.2f}x" for m, v in sorted(floor.items()))
              + "."]
    lines += ["", "Targets (4-bit weights): " + ", ".join(
        f"M = {m} >= {t}x: " + ", ".join(f"{k} {_geo(geo[k][m]):.2f}x ({'met' if _geo(geo[k][m]) >= t else 'not met'})"
                                       for k in sorted(geo) if geo[k][m]) for m, t in TARGETS.items()) + ".", ""]
    lines += ["## fp16 x int4 per shape: us / speedup (default tile, best candidate tile, before)", "",
              "| M | N x K | cuBLAS fp16 | default | best tile | before |", "|---|---|---|---|---|---|"]
    for m in ms:
        for n, k in shapes:
            cub = cell.get((m, n, k, "fp16 x fp16", "cublas_fp16"))
            d = cell.get((m, n, k, "fp16 x int4", "default"))
            if not cub or not d:
                continue
            tiles = [r for (mm, nn, kk, key, c), r in cell.items()
                     if (mm, nn, kk, key) == (m, n, k, "fp16 x int4") and (c.startswith("tile") or c == "default")]
            best = min(tiles, key=lambda r: r["time_us"])
            bef = [cell[c] for c in ((m, n, k, "fp16 x int4", "before: mma"), (m, n, k, "fp16 x int4", "before: dequant"))
                   if c in cell]
            bf = min(bef, key=lambda r: r["time_us"]) if bef else None
            lines.append(f"| {m} | {n}x{k} | {cub['time_us']:.1f} | {d['time_us']:.1f} / {d['speedup']:.2f}x "
                         f"({d.get('tile') or d['kernel']}, {d.get('splits') or 1} splits) | "
                         f"{best['time_us']:.1f} / {best['speedup']:.2f}x ({best.get('tile') or best['kernel']}) | "
                         + (f"{bf['time_us']:.1f} / {bf['speedup']:.2f}x ({bf['kernel']})" if bf else "-") + " |")
    lines += ["", "## fp16 x int4: geomean speedup of each prefill tile over the shapes (the profiling step)", "",
              "| M | tile: geomean speedup (the scheduler's tile first) |", "|---|---|"]
    for m in ms:
        per = defaultdict(list)
        for (mm, n, k, key, c), r in cell.items():
            if mm == m and key == "fp16 x int4" and r.get("tile"):
                per[(c == "default" or c == "tc", r["tile"])].append(r["speedup"])
        if per:
            ranked = sorted(per.items(), key=lambda kv: (not kv[0][0], -_geo(kv[1])))
            lines.append(f"| {m} | " + ", ".join(f"{t}: {_geo(v):.2f}x" + (f" ({len(v)} shapes)" if len(v) < len(shapes) else "")
                                                  for (_, t), v in ranked) + " |")
    return "\n".join(lines + errors(data, lambda r: f"{_key(r)} {r['config']}")) + "\n"


if __name__ == "__main__":
    main(render)
