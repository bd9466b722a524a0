"""Error of Ape's emulated types in the numpy model (CPU, no GPU), for docs/ape.md.

    python benchmarks/ape_model_errors.py [--out benchmarks/results]

Per type and input range: the largest relative representation error of the split
(|Hi + Lo (+ Mi) - x| / |x|, over 200,000 values) and the GEMM error of `reference_matmul`
(componentwise, max |C - C64| / (|A| |B|), 64 x 1024 x 64, A from the range, B with
magnitudes in [0.5, 2), inside every type, so that C shows what A's range does; A capped at
2^100 where the range allows, as sums near 2^127 overflow in any type),
next to an fp32 GEMM's (numpy, i.e. SGEMM on the CPU) and "auto"'s on the same inputs.
Writes ape-model.json and ape-model.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
from pathlib import Path

import numpy as np

from powerfusion import ape
from powerfusion.ape import FP32_B, FP32_F, FP32_T

F32_MIN_NORMAL = 2.0 ** -126


def log_uniform(rng, lo, hi, shape):
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def ranges(t):
    """(name, lo, hi) magnitude ranges for type t."""
    return [("N(0,1)", None, None),
            ("inside", t.min_abs, t.max_abs),
            ("below (x 2^-8 .. x 1)", t.min_abs * 2.0 ** -8, t.min_abs),
            ("above (x 1 .. x 2)", t.max_abs, min(t.max_abs * 2, 3.4e38)),
            ("fp32 subnormal", 2.0 ** -149, F32_MIN_NORMAL)]


def sample(rng, lo, hi, shape):
    if lo is None:
        return rng.standard_normal(shape).astype(np.float32)
    x = log_uniform(rng, lo, hi, shape)
    return np.where(np.abs(x) >= hi, np.float32(lo), x).astype(np.float32)


def gemm_error(c, a, b) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    den = np.abs(a64) @ np.abs(b64)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(c.astype(np.float64) - a64 @ b64) / np.where(den > 0, den, 1)
    return float(np.max(err)) if np.all(np.isfinite(c)) else float("inf")


def rows():
    rng = np.random.default_rng(19)
    out = []
    for t in (FP32_F, FP32_T, FP32_B):
        for name, lo, hi in ranges(t):
            x = sample(rng, lo, hi, 200_000)
            with np.errstate(over="ignore", invalid="ignore"):
                rec = ape.reconstruct(ape.split(x, t), t)
                rep = np.abs(rec - x.astype(np.float64)) / np.abs(x.astype(np.float64))
            rep_err = float(np.max(rep)) if np.all(np.isfinite(rec)) else float("inf")
            nonfinite = int(np.count_nonzero(~np.isfinite(rec)))
            # sums of 1024 terms near 2^127 overflow fp32 whatever the type: cap A at 2^100 there
            hi_a = min(hi, 2.0 ** 100) if lo is not None and lo < 2.0 ** 100 else hi
            a, b = sample(rng, lo, hi_a, (64, 1024)), sample(rng, 0.5, 2.0, (1024, 64))
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                emu = gemm_error(ape.reference_matmul(a, b, t.name), a, b)
                sgemm = gemm_error(a @ b, a, b)
                auto = gemm_error(ape.reference_matmul(a, b, "auto"), a, b)
            out.append({"type": t.name, "range": name, "lo": lo, "hi": hi, "representation_error": rep_err,
                        "nonfinite_splits": nonfinite, "gemm_error": emu, "sgemm_error": sgemm, "auto_error": auto})
    return out


def markdown(rs) -> str:
    lines = ["| type | inputs | max repr. error | non-finite splits / 200k | GEMM error | fp32 GEMM error | auto error |",
             "|---|---|---|---|---|---|---|"]
    for r in rs:
        rng = r["range"] if r["lo"] is None else f"{r['range']}: [{r['lo']:.3g}, {r['hi']:.3g})"
        lines.append(f"| {r['type']} | {rng} | {r['representation_error']:.2e} | {r['nonfinite_splits']} | "
                     f"{r['gemm_error']:.2e} | {r['sgemm_error']:.2e} | {r['auto_error']:.2e} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    rs = rows()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    meta = {"device": f"CPU ({platform.machine()}, numpy {np.__version__})",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit}
    (args.out / "ape-model.json").write_text(json.dumps({"meta": meta, "rows": rs}, indent=1))
    md = (f"# Ape's types in the numpy model ({meta['device']}, {meta['date']}, commit {commit})\n\n"
          + markdown(rs))
    (args.out / "ape-model.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
