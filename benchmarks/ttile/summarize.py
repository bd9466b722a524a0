"""ttile_bench.json -> ttile_bench.md: per-shape table, M = 1 geomeans and the floors."""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

FLOORS = {("fp16", "int4"): 2.5, ("int8", "int2"): 4.0}


def best_rows(rows):
    """Keep the fastest tiling variant per (M, N, K, A, W, zeros)."""
    best = {}
    for r in rows:
        if "time_us" not in r:
            continue
        key = (r["M"], r["N"], r["K"], r["A"], r["W"], r.get("zeros"), r["kernel"])
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    return list(best.values())


def render(data) -> str:
    meta, rows = data["meta"], best_rows(data["rows"])
    lines = [f"# Typed GEMM benchmark ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             f"D2D copy bandwidth measured in the same run: {meta['copy_bandwidth_GBps']:.0f} GB/s. "
             f"Timing: {meta['method']}.", "",
             "| M | N x K | A x W | kernel | time (us) | vs cuBLAS fp16 | % of copy BW |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["M"], r["N"], r["K"], r["kernel"] != "cublas_fp16", r["A"], r["W"])):
        w = r["W"] + (f"/{r['zeros']}" if r.get("zeros") else "")
        kern = r["kernel"] + (" (scheduler's choice)" if r.get("chosen") and r["M"] > 1 else "")
        lines.append(f"| {r['M']} | {r['N']}x{r['K']} | {r['A']} x {w} | {kern} | {r['time_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {100 * r['frac_copy_bw']:.0f}% |")
    geo = defaultdict(list)
    for r in rows:
        if r["M"] == 1 and r["kernel"] != "cublas_fp16":   # M = 1 runs one path: the fused CUDA-core kernel
            geo[(r["A"], r["W"], r.get("zeros"))].append(r["speedup"])
    lines += ["", "## M = 1, geomean speedup over cuBLAS fp16 (4 shapes)", "",
              "| A x W | geomean | min | floor |", "|---|---|---|---|"]
    for (a, w, z), v in sorted(geo.items(), key=lambda kv: -math.prod(kv[1]) ** (1 / len(kv[1]))):
        g = math.prod(v) ** (1 / len(v))
        floor = FLOORS.get((a, w), 1.0)
        ok = "met" if g >= floor and min(v) >= 1.0 else "NOT met"
        lines.append(f"| {a} x {w}{'/' + z if z else ''} | {g:.2f}x | {min(v):.2f}x | >= {floor}x geomean, "
                     f">= 1x each: {ok} |")
    tiles = defaultdict(lambda: defaultdict(list))
    for r in data["rows"]:
        if r["M"] == 1 and r.get("kernel") == "typed" and "time_us" in r:
            tiles[(r["A"], r["W"], r.get("zeros"))][(r["R"], r["ksplit"])].append(r["speedup"])
    tuned = {k: v for k, v in tiles.items() if len(v) > 1}
    if tuned:
        lines += ["", "## M = 1, geomean per fixed tiling (rows per warp R, warps splitting K)", "",
                  "| A x W | " + " | ".join(f"R={a} ks={b}" for a, b in sorted(next(iter(tuned.values())))) + " |",
                  "|---|" + "---|" * len(next(iter(tuned.values())))]
        for (a, w, z), v in tuned.items():
            cells = [f"{math.prod(x) ** (1 / len(x)):.2f}x" for _, x in sorted(v.items())]
            lines.append(f"| {a} x {w} | " + " | ".join(cells) + " |")
        lines += ["", "The geomean table above takes the fastest candidate per shape (the profiling step of "
                  "hint-based scheduling); `codegen.DEFAULT_R` holds the best fixed choice."]
    errs = [r for r in data["rows"] if "error" in r]
    if errs:
        lines += ["", "## Errors", ""] + [f"- M={r['M']} {r['A']} x {r['W']}: {r['error']}" for r in errs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    src = Path(sys.argv[1])
    data = json.loads(src.read_text())
    (src.parent / "ttile_bench.md").write_text(render(data))
    print(render(data))
