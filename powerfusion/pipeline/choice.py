"""What the plan search answers for one subgraph: `PlanChoice` (the chosen plan, rewritten, with
what the search saw) and `RankedPlan` (one of the best plans it compared)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from powerfusion.gir.ir import GIRGraph
from powerfusion.perfmodel.cost import Estimate


@dataclass(frozen=True)
class RankedPlan:
    labels: tuple[str, ...]        # template label per basic op (lowering order)
    predicted_s: float
    measured_s: float | None = None
    kernels: int = 0
    note: str = ""                 # why it was dropped ("" when it was a valid candidate)


@dataclass(frozen=True)
class PlanChoice:
    graph: GIRGraph                # the chosen plan, optimised
    merged: GIRGraph               # the same plan before rewriting
    trace: tuple = ()              # rewrite.TraceStep of every rule application
    predicted_s: float = math.inf
    measured_s: float | None = None
    estimate: Estimate | None = None
    considered: int = 0            # plans enumerated
    rewritten: int = 0             # plans optimised and predicted
    pruned: int = 0                # plans skipped by the bound or the beam
    infeasible: int = 0            # plans the lowering, verifier or renderer rejected
    top: tuple[RankedPlan, ...] = ()
    key: str = ""
    source: str = "search"         # "search" | "memo" | "disk"
    seconds: float = 0.0           # wall time spent choosing
    labels: tuple[str, ...] = field(default=())
    note: str = ""                 # set when no rewritten plan was feasible and a merged plan runs as lowered,
                                   # or when the time budget left plans untried
    unsearched: int = 0            # plans not rewritten because the time budget ran out
