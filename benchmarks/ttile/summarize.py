"""ttile.json -> ttile.md: geomean speedups over cuBLAS fp16 per type and M, the fraction of copy
bandwidth over the packed weight bytes at M = 1, and the issue's targets.

    python benchmarks/ttile/summarize.py OUT/ttile.json     (writes OUT/ttile.md)
"""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

# (A, W) -> M = 1 geomean speedup over cuBLAS fp16 the work aims at; every shape >= 0.80 of copy BW
M1_TARGETS = {("fp16", "int4"): 3.4, ("fp16", "nf4"): 3.2, ("fp16", "fp8_e4m3"): 1.85, ("int8", "int2"): 6.5,
              ("int8", "int1"): 8.0}
BW_TARGET = 0.80
FOUR_BIT = ("int4", "uint4", "nf4", "fp4_e2m1", "mxfp4")


def _geo(v):
    return math.prod(v) ** (1 / len(v)) if v else float("nan")


def _key(r):
    return (r["A"], r["W"] + (f"/{r['zeros']}" if r.get("zeros") else ""))


def _rows(data, default_only):
    """Typed rows with their cuBLAS time; default_only: the scheduler's fixed tiling, else the best per shape."""
    best = {}
    for r in data["rows"]:
        if "time_us" not in r or r["kernel"] == "cublas_fp16" or (default_only and not r.get("default")):
            continue
        k = (r["M"], r["N"], r["K"]) + _key(r)
        if k not in best or r["time_us"] < best[k]["time_us"]:
            best[k] = r
    return list(best.values())


def render(data) -> str:
    meta = data["meta"]
    shapes = sorted({(r["N"], r["K"]) for r in data["rows"]})
    lines = [f"# Typed GEMM benchmark ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             f"Copy bandwidth measured in the same run ({meta.get('copy_bandwidth_by', 'copy')}, read + write): "
             f"{meta['copy_bandwidth_GBps']:.0f} GB/s. Timing: {meta['method']}. Shapes (N x K): "
             + ", ".join(f"{n}x{k}" for n, k in shapes) + ". Speedup: cuBLAS fp16 time / ours, same run. "
             "BW: packed weight + scale bytes / time / copy bandwidth (1.0 = the bandwidth floor).", ""]
    if meta.get("incomplete"):
        lines += [f"**Incomplete run:** {meta['incomplete']}.", ""]
    dflt, best = _rows(data, True), _rows(data, False)
    by_m = defaultdict(lambda: defaultdict(list))
    for r in dflt:
        by_m[_key(r)][r["M"]].append(r["speedup"])
    ms = sorted({r["M"] for r in dflt})
    lines += ["## Geomean speedup over cuBLAS fp16 (scheduler's default kernel and tiling)", "",
              "| A x W | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
    for k in sorted(by_m):
        lines.append(f"| {k[0]} x {k[1]} | " + " | ".join(f"{_geo(by_m[k][m]):.2f}x" if by_m[k][m] else "-"
                                                          for m in ms) + " |")
    lines += ["", "## M = 1 against the targets", "",
              "| A x W | geomean (default) | geomean (best tiling) | BW min-max | target | met |",
              "|---|---|---|---|---|---|"]
    m1d, m1b = defaultdict(list), defaultdict(list)
    for r in dflt:
        if r["M"] == 1:
            m1d[_key(r)].append(r)
    for r in best:
        if r["M"] == 1:
            m1b[_key(r)].append(r)
    for k in sorted(m1d):
        gd = _geo([r["speedup"] for r in m1d[k]])
        gb = _geo([r["speedup"] for r in m1b[k]])
        fr = [r["frac_copy_bw"] for r in m1b[k]]
        tgt = M1_TARGETS.get((k[0], k[1]))
        met = "-" if tgt is None else ("yes" if gb >= tgt and min(fr) >= BW_TARGET else "no")
        lines.append(f"| {k[0]} x {k[1]} | {gd:.2f}x | {gb:.2f}x | {min(fr):.2f}-{max(fr):.2f} | "
                     f"{'-' if tgt is None else f'>= {tgt}x, BW >= {BW_TARGET}'} | {met} |")
    lines += ["", "W1A8 is int8 x int1 (int1 holds {-1, 0} x scale), W1A16 fp16 x int1.", ""]
    for m, tgt in ((16, 1.5), (256, 1.0)):
        g = {k: _geo(by_m[k][m]) for k in by_m if by_m[k][m] and k[1] in FOUR_BIT}
        if g:
            lines.append(f"M = {m}, 4-bit weights (target >= {tgt}x): " +
                         ", ".join(f"{a} x {w} {v:.2f}x" for (a, w), v in sorted(g.items())) + ".")
    lines += ["", "## M = 1 per shape (best tiling): time us / speedup / BW", "",
              "| A x W | " + " | ".join(f"{n}x{k}" for n, k in shapes) + " |", "|---|" + "---|" * len(shapes)]
    cub = {(r["N"], r["K"]): r for r in data["rows"] if r.get("kernel") == "cublas_fp16" and r["M"] == 1}
    lines.append("| cuBLAS fp16 | " + " | ".join(f"{cub[s]['time_us']:.1f}" if s in cub else "-" for s in shapes) + " |")
    for k in sorted(m1b):
        cells = {(r["N"], r["K"]): r for r in m1b[k]}
        lines.append(f"| {k[0]} x {k[1]} | " + " | ".join(
            f"{c['time_us']:.1f} / {c['speedup']:.2f}x / {c['frac_copy_bw']:.2f}" if (c := cells.get(s)) else "-"
            for s in shapes) + " |")
    return "\n".join(lines + errors(data, lambda r: f"{r['A']} x {r['W']}")) + "\n"


def errors(data, describe) -> list[str]:
    """The markdown lines listing the runs that failed (at most 20), `describe(row)` naming each."""
    errs = [r for r in data["rows"] if "error" in r]
    if not errs:
        return []
    return ["", "## Errors", ""] + [f"- M={r['M']} {r['N']}x{r['K']} {describe(r)}: {r['error']}" for r in errs[:20]]


def main(render_fn) -> None:
    """`python SCRIPT RESULTS.json`: writes RESULTS.md beside it and prints it."""
    src = Path(sys.argv[1])
    text = render_fn(json.loads(src.read_text()))
    src.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(render)
