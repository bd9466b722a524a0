"""The greedy rewrite driver (the paper's Algorithm 1), with a trace of every application.

    repeat:
        apply SYNC_RULES and SWAP_RULES until none applies
        apply MERGE_RULES until none applies
    until the merge phase changed nothing

Termination. Every rule application strictly decreases `measure(graph)`, a tuple of
non-negative integers compared lexicographically:
  1. modelled global bytes, 2. modelled total bytes (no rule raises either: each rule
     refuses a rewrite that would, and the driver checks it);
  3. sum over the slices of non-sync gOperators of 4**level (a read re-sourced from a
     faster level, a promotion between levels of equal traffic);
  4. sum over syncs of 4**scope (a narrower sync replacing a wider one);
  5. the number of gOperators; 6. the number of slices named by syncs;
  7. sum over elementwise gOperators of the gOperators after them (swaps only move
     elementwise forward; they keep 1-6 equal);
  8. sum over moves of the length of the move chain feeding them (a composition that keeps
     its first move, through an intermediate at the same level, shortens it).
Promotion lowers global bytes (or, from shared memory, 3. or 4.); merges delete
gOperators or bytes; the split composition of a concat/split (W writers, R readers,
W*R <= W+R moves) deletes the intermediate's bytes.
The driver checks that decrease at every step (and that modelled traffic does not rise),
and an iteration cap backs it: exceeding it is a bug and raises.

Dispatch. At each position the driver tries only the rules declared (`@matches`, base.py) for
that gOperator's kind, in table order: the first that fires is the one that would fire if
every rule were tried there, since an undeclared rule never fires on that kind
(tests/unit/rewrite/test_dispatch.py compares both on every example graph).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

from powerfusion.gir.ir import Elementwise, GIRGraph, Sync
from powerfusion.gir.traffic import not_worse, total_bytes, traffic, traffic_after
from powerfusion.rewrite.base import KINDS, is_move, op_facts
from powerfusion.rewrite.merge_rules import MERGE_RULES
from powerfusion.rewrite.swap_rules import SWAP_RULES
from powerfusion.rewrite.sync_rules import SYNC_RULES

PHASES = (("sync+swap", {**SYNC_RULES, **SWAP_RULES}), ("merge", MERGE_RULES))
ALL_RULES = {**SYNC_RULES, **SWAP_RULES, **MERGE_RULES}


class RewriteInvariantError(AssertionError):
    """A rule broke a driver invariant (traffic rose, or the termination measure did not drop)."""


@dataclass(frozen=True)
class TraceStep:
    rule: str
    before: GIRGraph
    after: GIRGraph
    changed: tuple[int, ...]   # uids (in `before`) of the gOperators replaced or removed


def measure(g: GIRGraph, t: dict[str, int] | None = None) -> tuple[int, ...]:
    t = traffic(g) if t is None else t
    weight = sync_weight = sync_slices = ew_pos = depth_sum = 0
    n = len(g.ops)
    # _chain_depth, in the same pass: a move's depth is one more than its source's last writer's
    # (when that writer is a move), summed over the moves
    depth: dict[int, int] = {}
    last_writer: dict[str, int] = {}
    for k, op in enumerate(g.ops):
        f = op_facts(op)   # each op's share worked out once per op object
        if f.sync:
            sync_weight += f.sync_weight
            sync_slices += f.sync_slices
            continue
        weight += f.weight
        if f.elementwise:
            ew_pos += n - 1 - k
        if f.move_source is not None:
            w = last_writer.get(f.move_source)
            d = 1 + depth[w] if w is not None and w in depth else 0
            depth[k] = d
            depth_sum += d
        for name in f.written:
            last_writer[name] = k
    return t["global"], total_bytes(t), weight, sync_weight, n, sync_slices, ew_pos, depth_sum


def _chain_depth(g: GIRGraph) -> int:
    depth: dict[int, int] = {}
    last_writer: dict[str, int] = {}
    for k, op in enumerate(g.ops):
        if is_move(op):
            w = last_writer.get(op.inputs[0].buffer)
            depth[k] = 1 + depth[w] if w is not None and w in depth else 0
        if not isinstance(op.args, Sync):
            for s in op.outputs:
                last_writer[s.buffer] = k
    return sum(depth.values())


def _unique_uids(g: GIRGraph) -> GIRGraph:
    uids = [op.uid for op in g.ops]
    if len(set(uids)) == len(uids) and 0 not in uids:
        return g
    return replace(g, ops=tuple(replace(op, uid=k + 1) for k, op in enumerate(g.ops)))


def _step_limit(g: GIRGraph) -> int:
    return 64 + 32 * len(g.ops)


def _check(name: str, before: GIRGraph, after: GIRGraph, tb: dict, mb: tuple) -> tuple[dict, tuple]:
    """Raise unless traffic did not rise and the measure dropped; returns after's (traffic, measure)."""
    ta = traffic_after(before, tb, after)
    if not not_worse(tb, ta):
        raise RewriteInvariantError(f"rule '{name}' raised modelled traffic on {before.name}: "
                                    f"global {tb['global']} -> {ta['global']}, total {total_bytes(tb)} -> {total_bytes(ta)}")
    ma = measure(after, ta)
    if not ma < mb:
        raise RewriteInvariantError(f"rule '{name}' did not decrease the termination measure on {before.name}: {mb} -> {ma}")
    return ta, ma


def by_kind(rules: dict) -> dict[str, tuple]:
    """gOperator kind -> the (name, rule) pairs of `rules` that can fire on it, in table order;
    a rule without a `kinds` declaration is listed under every kind."""
    return {kind: tuple((name, rule) for name, rule in rules.items() if kind in getattr(rule, "kinds", KINDS))
            for kind in KINDS}


def _exhaust(g: GIRGraph, rules: dict, trace: list[TraceStep], limit: int,
             every_rule: bool = False) -> tuple[GIRGraph, bool]:
    """Apply `rules` until none applies anywhere; returns (graph, whether anything changed).
    Only the rules declared for a gOperator's kind are tried on it (every_rule: all of them)."""
    table = by_kind(rules) if not every_rule else dict.fromkeys(KINDS, tuple(rules.items()))
    changed = False
    start = 0
    tb = traffic(g)
    mb = measure(g, tb)
    while True:
        hit = None
        for at in range(start, len(g.ops)):
            for name, rule in table[g.ops[at].kind]:
                rw = rule(g, at)
                if rw is not None:
                    hit = (name, rw, at)
                    break
            if hit:
                break
        if hit is None:
            if start == 0:
                return g, changed
            start = 0      # a final sweep from the top confirms the fixpoint
            continue
        name, rw, at = hit
        new = rw.apply(g)
        tb, mb = _check(name, g, new, tb, mb)
        trace.append(TraceStep(name, g, new, rw.changed))
        if len(trace) > limit:
            raise RewriteInvariantError(f"rewriting {g.name} exceeded {limit} steps")
        g, changed, start = new, True, max(0, at - 1)


def _key(g: GIRGraph) -> tuple:
    """Structural identity: gOperator equality ignores uids and names of the graph itself."""
    data = hashlib.sha256()
    for name, arr in g.constants:
        data.update(name.encode())
        data.update(np.asarray(arr, order="C").tobytes())
    return g.parallel, g.buffers, g.ops, g.inputs, g.outputs, data.hexdigest()


_MEMO: dict[tuple, tuple[GIRGraph, tuple[TraceStep, ...]]] = {}


def optimise(graph: GIRGraph, *, every_rule: bool = False) -> tuple[GIRGraph, list[TraceStep]]:
    """Rewrite `graph` greedily to a fixpoint; returns the result and the trace of every step.
    Structurally equal graphs (repeated layers) are optimised once (memo by structural hash).
    every_rule: try every rule at every gOperator, not only those declared for its kind (the
    reference the dispatch is tested against; not memoised)."""
    key = _key(graph)
    if key in _MEMO and not every_rule:
        out, trace = _MEMO[key]
        return replace(out, name=graph.name, templates=graph.templates), list(trace)
    g = _unique_uids(graph)
    trace: list[TraceStep] = []
    limit = _step_limit(g)
    while True:
        g, _ = _exhaust(g, PHASES[0][1], trace, limit, every_rule)
        g, merged = _exhaust(g, PHASES[1][1], trace, limit, every_rule)
        if not merged:
            break
    if not every_rule:
        _MEMO[key] = (g, tuple(trace))
    return g, trace


def clear_memo() -> None:
    _MEMO.clear()
