"""The adapter (Ape, section 5): from block masks of A and B to a plan.

Ape's own kernels pick the type per (C block, K block) pair. Our device GEMMs are cuBLAS
calls, which take one type per call, so the executable unit of mixing is a K panel: a panel
of K (all rows of A, all columns of B) runs as FP32-F when every block of A's column panel and
of B's row panel is FP32-F, as FP32-B when they are all at most FP32-B, else as plain fp32
(SGEMM). Panels of one kind are gathered (K may be permuted freely) into one GEMM per kind,
all accumulating into C. `f_block_fraction` still counts the paper's Mask_C = Mask_A x
Mask_B, the FP32-F share a per-block kernel could reach, next to what the panels reach.

The decider predicts the time of pure FP32-B, mixed, and SGEMM from measured per-type speeds
(seconds per flop at the GEMM's size, `Speeds`) and picks the fastest one that is exact
enough: FP32-F only on F panels, fp32 wherever a panel needs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference import MASK_B, MASK_F, MASK_FP32, PANEL, panel_classes

MASK_ROWS = 128      # rows (of A) / columns (of B) per mask block


def f_block_fraction(mask_a: np.ndarray, mask_b: np.ndarray) -> float:
    """The paper's count: Mask_C = [Mask_A == F] x [Mask_B == F] gives, per C block, the
    number of K blocks both of whose operands are FP32-F; their share of all block products."""
    fa = (np.asarray(mask_a) == MASK_F).astype(np.int64)
    fb = (np.asarray(mask_b) == MASK_F).astype(np.int64)
    total = fa.shape[0] * fa.shape[1] * fb.shape[1]
    return float((fa @ fb).sum()) / total if total else 1.0


@dataclass(frozen=True)
class Speeds:
    """Measured seconds per flop (2 M N K) of each GEMM kind at the size being planned,
    and the fixed cost of one more GEMM launch."""
    f: float
    b: float
    fp32: float
    launch: float = 5e-6


@dataclass(frozen=True)
class Plan:
    """Which K panels run as which kind; `kind` names the plan ("fp32-f", "fp32-b",
    "mixed", "fp32")."""
    kind: str
    panel_kind: tuple[int, ...]   # per K panel: MASK_F / MASK_B / MASK_FP32 as executed
    f_fraction_blocks: float      # the paper's Mask_C share of FP32-F block products
    predicted_s: float

    def panels(self, cls: int) -> np.ndarray:
        return np.flatnonzero(np.asarray(self.panel_kind) == cls)


def _predict(counts: dict[int, int], speeds: Speeds, flops_per_panel: float) -> float:
    per = {MASK_F: speeds.f, MASK_B: speeds.b, MASK_FP32: speeds.fp32}
    used = [c for c, n in counts.items() if n]
    return sum(n * flops_per_panel * per[c] for c, n in counts.items()) + speeds.launch * max(0, len(used) - 1)


def decide(panel_cls: np.ndarray, speeds: Speeds, flops_per_panel: float,
           f_fraction_blocks: float = float("nan")) -> Plan:
    """Pure FP32-F when every panel allows it; else the fastest of pure FP32-B (F panels
    promoted), mixed, and SGEMM; panels that need fp32 run as fp32 in every plan."""
    cls = np.asarray(panel_cls, np.int8)
    n = {c: int((cls == c).sum()) for c in (MASK_F, MASK_B, MASK_FP32)}
    if n[MASK_F] == len(cls):
        return Plan("fp32-f", tuple(cls.tolist()), f_fraction_blocks, _predict(n, speeds, flops_per_panel))
    promoted = np.where(cls == MASK_F, MASK_B, cls).astype(np.int8)
    # on a tie (no F panels) the plan with fewer GEMMs, listed first, wins
    options = [
        ("fp32-b", promoted, _predict({MASK_F: 0, MASK_B: n[MASK_F] + n[MASK_B], MASK_FP32: n[MASK_FP32]},
                                      speeds, flops_per_panel)),
        ("mixed", cls, _predict(n, speeds, flops_per_panel)),
        ("fp32", np.full_like(cls, MASK_FP32), _predict({MASK_FP32: len(cls)}, speeds, flops_per_panel)),
    ]
    kind, chosen, t = min(options, key=lambda o: o[2])
    if kind == "fp32-b" and n[MASK_FP32]:
        kind = "mixed"   # B panels and fp32 panels together
    return Plan(kind, tuple(chosen.tolist()), f_fraction_blocks, t)
