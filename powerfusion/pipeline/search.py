"""Plan search for one memory-bound subgraph: `choose_plan(subgraph, graph, target)`.

    plans     = lower.enumerate_plans(...)           template choice x parameters x merge plan
    merged    = lower_subgraph(plan) for each         (cheap)
    bound     = optimistic estimate of each merged    (interface traffic only, one kernel)
    for plans in order of bound, while bound < best and fewer than `beam` rewritten
                                 (and `plans` in all, with the polish below):
        optimised = rewrite.optimise(merged)          (the expensive step)
        its one-pass form (rewrite/onepass.py) where a rule applies: the faster of the two
        drop it if the renderer's layout check rejects it
        predicted = predict_seconds(estimate(optimised))
    keep the best that the verifier accepts (with tune=True: verify the top-k, time them on
    the device, keep the fastest)
    if every rewritten plan was rejected: the best feasible merged plan, as lowered (noted)

The budget is a count of evaluated (rewritten and predicted) plans, `plans` (SEARCH_PLANS;
`options.search_plans`, POWERFUSION_SEARCH_PLANS), shrunk for large subgraphs by their size
(`plan_budget`: rewriting costs grow with the merged graph's gOperators), so the plan chosen
depends only on the subgraph, never on the machine's speed or load. The default choice is
always rewritten. A wall-clock safety cap, `budget_s` (SEARCH_CAP_S), stops a search that
runs far past what the count allows: an alternative is rewritten only while the wall time so
far plus the slowest rewrite fits. Only the cap depends on the machine; where it cut,
PlanChoice.note and `unsearched` say how many plans were not tried, and the decision is not
reused by a call without a cap (budget_s=None), which searches again.

Decisions are cached by the subgraph's structural hash (op kinds, arguments, shapes,
dtypes -- not names), in memory and on disk under `options.current().cache_dir / "plans"`;
a hit re-lowers the cached choice under this subgraph's names and renames the cached
optimised graph onto it (plancache.py), so repeated layers and warm compiles skip search.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from powerfusion.targets.registry import backend
from powerfusion.basic import BasicGraph, Subgraph
from powerfusion.gir.ir import GIRGraph, Level, Sync
from powerfusion.perfmodel.cost import Estimate, estimate, predict_seconds
# the search's answer types live apart, so that the plan cache's codec reads them without this module
from powerfusion.pipeline.choice import PlanChoice, RankedPlan  # noqa: F401
from powerfusion.targets.specs import TargetSpec, get_target

TOP_K = 8
REJECTED_RUN = 2    # rewritten plans rejected in a row (nothing valid yet) before falling back
PROGRESS_MIN = 12   # show a progress bar from this many candidates on
SEARCH_PLANS = 14   # evaluated plans per subgraph: the beam (8) and the anchor polish (6) together
PLAN_WORK = 2000    # gOperators rewritten per subgraph (plans x merged size) before the count shrinks
# wall seconds per subgraph beyond which alternatives are not tried: a safety cap that a
# normal search never reaches (POWERFUSION_SEARCH_BUDGET_S overrides)
SEARCH_CAP_S = 120.0
SEARCH_BUDGET_S = SEARCH_CAP_S   # the name callers and tests know


def choose_plan(subgraph: Subgraph, graph: BasicGraph, target: TargetSpec | str = "cuda", *, tune: bool = False,
                beam: int = 8, progress=None, limit: int = 32, cache: bool = True,
                budget_s: float | None = SEARCH_CAP_S, plans: int | None = SEARCH_PLANS) -> PlanChoice:
    """The best plan the model (or, with tune=True, the device) finds for `subgraph` among at most
    `plan_budget(plans, ...)` evaluated plans (None: no count limit), within the wall-clock safety
    cap `budget_s` (None: none)."""
    from powerfusion.pipeline import plancache
    t0 = time.perf_counter()
    t = get_target(target) if isinstance(target, str) else target
    key = plancache.structural_key(subgraph, graph, t)
    if cache:
        hit = plancache.lookup(key, subgraph, graph, t, want_measured=tune)
        if hit is not None and not (hit.unsearched and budget_s is None):
            return replace(hit, seconds=time.perf_counter() - t0)
    choice = _search(subgraph, graph, t, tune=tune, beam=beam, progress=progress, limit=limit, budget_s=budget_s,
                     plans=plans)
    choice = replace(choice, key=key, seconds=time.perf_counter() - t0)
    if cache:
        plancache.store(key, subgraph, graph, t, choice)
    return choice


def choose_plans(subgraphs, graph: BasicGraph, target: TargetSpec | str = "cuda", *, jobs: int = 1,
                 **kw) -> list[PlanChoice]:
    """choose_plan for every subgraph of a model: one search per distinct structural key (the
    rest are cache hits), the distinct searches spread over `jobs` forked processes."""
    from powerfusion.pipeline import plancache
    t = get_target(target) if isinstance(target, str) else target
    keys = [plancache.structural_key(s, graph, t) for s in subgraphs]
    first = list({k: i for i, k in reversed(list(enumerate(keys)))}.values())
    if jobs > 1 and len(first) > 1 and kw.get("cache", True):
        _search_in_pool([subgraphs[i] for i in first], graph, t, jobs, kw)
    return [choose_plan(s, graph, t, **kw) for s in subgraphs]


_POOL_ARGS: tuple = ()


def _pool_task(k: int) -> None:
    subs, graph, t, kw = _POOL_ARGS
    choose_plan(subs[k], graph, t, **kw)   # stores the decision on disk for the parent


def _search_in_pool(subs, graph, t, jobs, kw) -> None:
    """Fork workers that inherit the (large) graph instead of pickling it; each writes its
    decision to the disk cache, where the parent's choose_plan finds it."""
    import multiprocessing as mp
    global _POOL_ARGS
    if mp.current_process().daemon:   # inside a multiprocessing.Pool worker, which may not fork children
        return                           # (a user's pool, or a precompile run): search in this process
    try:
        ctx = mp.get_context("fork")
    except ValueError:  # no fork on this platform: search in this process
        return
    _POOL_ARGS = (subs, graph, t, {**kw, "progress": False})
    try:
        with ctx.Pool(min(jobs, len(subs))) as pool:
            pool.map(_pool_task, range(len(subs)), chunksize=1)
    finally:
        _POOL_ARGS = ()


# ---- search -------------------------------------------------------------------------------

@dataclass
class _Cand:
    plan: dict
    labels: tuple[str, ...]
    merged: GIRGraph
    bound: float
    optimised: GIRGraph | None = None
    trace: tuple = ()
    estimate: Estimate | None = None
    predicted: float = math.inf
    note: str = ""


def plan_budget(plans: int | None, merged_ops: int) -> int | None:
    """Plans to evaluate for a subgraph whose default plan merges to `merged_ops` gOperators:
    `plans`, fewer where plans x size passes PLAN_WORK (a rewrite's cost grows with the graph),
    never fewer than one. A function of the subgraph alone, so the choice is reproducible."""
    if plans is None:
        return None
    return max(1, min(plans, PLAN_WORK // max(1, merged_ops)))


def _search(sub: Subgraph, graph: BasicGraph, t: TargetSpec, *, tune: bool, beam: int, progress,
            limit: int, budget_s: float | None = None, plans: int | None = SEARCH_PLANS) -> PlanChoice:
    from powerfusion.templates.merge import LowerError, enumerate_plans, lower_subgraph, lowering_context
    ctx = lowering_context(sub, graph, t)   # one memo of matched edges for every plan
    count = plans
    plans = [None] + enumerate_plans(sub, graph, t, limit=limit, ctx=ctx)  # None: lower_subgraph's default choice
    cands, infeasible = [], 0
    for plan in plans:
        try:
            merged = lower_subgraph(sub, graph, plan, t, ctx=ctx)
        except LowerError:
            infeasible += 1
            continue
        labels = tuple(label for _, label in merged.templates) if plan is None else \
            tuple(c.label for c in plan.values())
        cands.append(_Cand(plan, labels, merged, optimistic_seconds(merged, t)))
    if not cands:
        from powerfusion.errors import PowerFusionError
        raise PowerFusionError(f"subgraph {sub.name}: none of {len(plans)} plans could be lowered for {t.name}")
    allowed = plan_budget(count, len(cands[0].merged.ops))
    main_beam = max(1, beam if allowed is None else min(beam, allowed))
    bar = _Progress(len(cands), sub.name, progress)
    # the default choice (plans[0], matched for fusion by the lowering) is always rewritten first,
    # so a run of rejected alternatives cannot leave the subgraph unfused
    # the default first, then the family descents (each a different parallel structure: one
    # unit per row, a group per row, a wide group per row), so that a time budget cut short on
    # a slow or busy machine still compares the structures; then by bound (within BOUND_TIE:
    # enumeration order)
    families = _family_labels(ctx)
    order = sorted(range(len(cands)), key=lambda k: (k != 0, cands[k].labels not in families,
                                                     _bucket(cands[k].bound), k))
    best, rewritten, pruned, rejected_run = math.inf, 0, 0, 0
    spent, slowest, unsearched = 0.0, 0.0, 0   # wall seconds of rewriting (the safety cap)
    for rank, k in enumerate(order):
        c = cands[k]
        # a rejected rewrite is a rule or renderer limitation, and it tends to hit every plan of
        # a subgraph alike: after REJECTED_RUN in a row with nothing valid, stop rewriting
        stop = rewritten >= main_beam or (c.bound >= best and rewritten) or \
            (rejected_run >= REJECTED_RUN and not math.isfinite(best))
        if stop:
            pruned += 1
            c.note = "pruned"
            bar.step()
            continue
        if rewritten and budget_s is not None and spent + slowest > budget_s:
            unsearched += 1    # one more rewrite would likely overrun the budget
            c.note = "not tried (time cap)"
            bar.step()
            continue
        t1 = time.monotonic()
        _evaluate(c, t)
        t1 = time.monotonic() - t1
        spent, slowest = spent + t1, max(slowest, t1)
        rewritten += 1
        if c.note:
            infeasible += 1
            rejected_run += 1
        else:
            best, rejected_run = min(best, c.predicted), 0
        bar.step()
    bar.done()
    polished = 0
    if math.isfinite(best) and (budget_s is None or spent + slowest <= budget_s):
        polish = min(POLISH_REWRITES, beam - 1) if allowed is None else \
            min(POLISH_REWRITES, beam - 1, allowed - rewritten)
        spent, extra, polished = _polish(sub, graph, t, ctx, cands, spent, slowest, budget_s, polish)
        rewritten, pruned = rewritten + extra, pruned + polished - extra
    valid = sorted((c for c in cands if c.optimised is not None and not c.note), key=lambda c: c.predicted)
    valid, rejected = _verified(valid, TOP_K if tune else 1)
    infeasible += rejected
    budget_note = "" if not unsearched else (
        f"time cap: rewrote {rewritten} of {len(cands)} lowered plans in {spent:.1f} s (slowest "
        f"{slowest:.1f} s, cap {budget_s:g} s); {unsearched} not tried, so a better plan may exist; ")
    note = ""
    if not valid:  # every rewritten plan was rejected: run a merged plan as lowered (correct, slower)
        skipped = ("pruned", "not tried (time cap)")
        note = "rewrites rejected: " + "; ".join(sorted({c.note for c in cands if c.note and c.note not in skipped})[:2])
        valid = _feasible_merged(cands, t)
    if not valid:
        from powerfusion.errors import PowerFusionError
        raise PowerFusionError(f"subgraph {sub.name}: no feasible plan for {t.name} ({note[:600]})")
    top = valid[:TOP_K]
    measured = {}
    if tune:
        from powerfusion.pipeline.tune import time_graphs
        times = time_graphs([c.optimised for c in top])
        measured = {id(c): s for c, s in zip(top, times)}
        top = sorted(top, key=lambda c: measured.get(id(c), math.inf))
    win = top[0]
    ranked = tuple(RankedPlan(c.labels, c.predicted, measured.get(id(c)), len(c.optimised.kernels()))
                   for c in top)
    return PlanChoice(win.optimised, win.merged, win.trace, win.predicted, measured.get(id(win)), win.estimate,
                      len(plans) + polished, rewritten, pruned, infeasible, ranked, labels=win.labels,
                      note=(budget_note + note)[:700].rstrip("; "), unsearched=unsearched)


POLISH_REWRITES = 6   # extra rewrites per subgraph for the anchor polish
ANCHORS = ("MatMul", "Reduce", "Conv")


def _polish(sub, graph, t, ctx, cands: list[_Cand], spent: float, slowest: float, budget_s,
            limit: int) -> tuple[float, int, int]:
    """One sweep of coordinate descent around the best plan over its anchor ops (MatMul,
    Reduce, Conv: the ops whose template fixes a kernel's parallel structure): each other
    candidate of one anchor, the other anchors kept, the remaining ops re-matched around
    them. enumerate_plans varies one op at a time from the default, so the best pairing of
    two anchors' choices (decode attention's q.K^T with its probs.V) is often not among its
    plans. Alternatives go in bound order, at most `limit` rewrites, within the time cap.
    Returns (wall seconds of rewriting so far, rewrites done, plans it lowered)."""
    from powerfusion.templates.merge import LowerError, lower_subgraph
    valid = [c for c in cands if c.optimised is not None and not c.note]
    if not valid or limit < 1:
        return spent, 0, 0
    best = min(valid, key=lambda c: c.predicted)
    labels = dict(best.merged.templates)
    anchors = {}
    for n in ctx.nodes:
        if type(n.op).__name__ in ANCHORS:
            chosen = next((c for c in ctx.candidates(n) if c.label == labels.get(n.name)), None)
            if chosen is None:
                return spent, 0, 0
            anchors[n.name] = (n, chosen)
    seen = {c.labels for c in cands} | {tuple(label for _, label in c.merged.templates) for c in cands}
    trials = []
    for name, (n, chosen) in anchors.items():
        for alt in ctx.candidates(n):
            if alt.label == chosen.label:
                continue
            fixed = {k: (alt if k == name else c) for k, (_, c) in anchors.items()}
            try:
                merged = lower_subgraph(sub, graph, fixed, t, ctx=ctx)
            except LowerError:
                continue
            key = tuple(label for _, label in merged.templates)
            if key in seen:
                continue
            seen.add(key)
            trials.append(_Cand(fixed, key, merged, optimistic_seconds(merged, t)))
    done = 0
    for c in sorted(trials, key=lambda c: c.bound):
        if done >= limit or c.bound >= best.predicted:
            break
        if budget_s is not None and spent + slowest > budget_s:
            break
        t1 = time.monotonic()
        _evaluate(c, t)
        t1 = time.monotonic() - t1
        spent, slowest = spent + t1, max(slowest, t1)
        done += 1
        cands.append(c)
        if not c.note and c.predicted < best.predicted:
            best = c
    return spent, done, len(trials)


def _family_labels(ctx) -> set:
    """Template labels (per op, lowering order) of the family descents enumerate_plans offers."""
    from powerfusion.templates.merge import _descend, _families
    out = set()
    for f in _families(ctx):
        try:
            ch = _descend(ctx, family=f)
        except Exception:   # a family no op can follow: enumerate_plans skips it the same way
            continue
        out.add(tuple(ch[n.name].label for n in ctx.nodes))
    return out


BOUND_TIE = 0.02   # relative: bounds closer than this rank as equal


def _bucket(bound: float) -> float:
    if not math.isfinite(bound) or bound <= 0:
        return bound
    return math.floor(math.log(bound) / math.log1p(BOUND_TIE))


def _feasible_merged(cands: list[_Cand], t: TargetSpec) -> list[_Cand]:
    """The first TOP_K feasible merged plans by predicted time (marked as running unrewritten).

    The verifier is the expensive part, and only the top TOP_K are used: the plans are
    estimated first and verified in order of prediction until TOP_K pass -- the same list as
    verifying all of them and sorting the feasible ones (a stable sort either way). A plan
    whose estimate fails before its verification falls back to verifying all."""
    try:
        preds = []
        for c in cands:
            e = estimate(c.merged, t)
            preds.append((e, predict_seconds(e, t)))
    except Exception:
        preds = None
    if preds is None or any(math.isnan(p) for _, p in preds):
        for c in cands:
            if not feasibility(c.merged, t):
                _run_merged(c, t)
        return sorted((c for c in cands if c.optimised is c.merged and math.isfinite(c.predicted)),
                      key=lambda c: c.predicted)
    valid = []
    for k in sorted(range(len(cands)), key=lambda k: preds[k][1]):
        c, (e, p) = cands[k], preds[k]
        if len(valid) >= TOP_K or not math.isfinite(p):
            break
        if not feasibility(c.merged, t):
            _run_merged(c, t, e, p)
            valid.append(c)
    return valid


def _run_merged(c: _Cand, t: TargetSpec, e: Estimate | None = None, p: float | None = None) -> None:
    c.optimised, c.trace, c.note = c.merged, (), ""
    c.estimate = e if e is not None else estimate(c.merged, t)
    c.predicted = p if p is not None else predict_seconds(c.estimate, t)


def _evaluate(c: _Cand, t: TargetSpec) -> None:
    from powerfusion.rewrite import optimise
    try:
        g, trace = optimise(c.merged)
    except Exception as e:  # a rule refusing this plan (invariant check) rejects the plan, not the model
        c.note = f"rewrite: {type(e).__name__}: {e}"[:300]
        return
    c.optimised, c.trace = g, tuple(trace)
    reason = feasibility(g, t, verify=False)   # the verifier runs on the plans that can win (_verified)
    if reason:
        c.note = reason
        return
    c.estimate = estimate(g, t)
    c.predicted = predict_seconds(c.estimate, t)
    if not math.isfinite(c.predicted):
        c.note = c.estimate.infeasible or "infeasible"
        return
    _one_pass(c, t)
    _replicated(c, t)


def _one_pass(c: _Cand, t: TargetSpec) -> None:
    """The plan's one-pass form (rewrite/onepass.py: a second statistic in the first one's pass,
    one more segment loaded per row), kept where the cost model predicts it faster: where the
    renderer streams the row, a pass less over DRAM; elsewhere the extra load and ops lose.
    Tried only for plans with a streamed kernel: nothing else can gain (and the verifier and
    renderer would run twice for every softmax and LayerNorm plan)."""
    from powerfusion.rewrite.onepass import one_pass_variant
    if "streamed" not in c.estimate.limits:
        return
    variant = one_pass_variant(c.optimised)
    if variant is None:
        return
    g, trace = variant
    if feasibility(g, t):
        return
    e = estimate(g, t)
    p = predict_seconds(e, t)
    if p < c.predicted:
        c.optimised, c.trace, c.estimate, c.predicted = g, c.trace + tuple(trace), e, p


# Groups up to this many units get the replicated variant. Measured on the H200 at 4 units (GPT-2 /
# ViT-B/16 LayerNorm rows, LayerNorm 32768x4096); a 16-unit LayerNorm row of 16384 fp32 without
# its barriers lets nvcc hoist the affine loads: 73 registers a lane instead of 58 (ptxas,
# sm_90), one 512-thread block per SM instead of two, which the register estimate does not see.
REPLICATE_MAX_GROUP = 8


def _replicated(c: _Cand, t: TargetSpec) -> None:
    """The plan with its group reductions finished by every unit (rewrite/replicate.py: the
    barrier that hands a group's result back goes, the partials are read by every unit), kept
    where the cost model (a barrier's cost per wave) predicts it faster. Tried only for plans
    with a BLOCK sync."""
    from powerfusion.gir.ir import Scope, Sync
    from powerfusion.rewrite.replicate import replicated_variant
    if not any(isinstance(op.args, Sync) and op.args.scope == Scope.BLOCK for op in c.optimised.ops):
        return
    if c.optimised.parallel.units_per_group > REPLICATE_MAX_GROUP:
        return
    try:
        variant = replicated_variant(c.optimised)
    except Exception:   # a rule refusing the variant (invariant check) leaves the plan as it was
        return
    if variant is None:
        return
    g, trace = variant
    if feasibility(g, t, verify=False):
        return
    e = estimate(g, t)
    p = predict_seconds(e, t)
    if p < c.predicted:
        c.optimised, c.trace, c.estimate, c.predicted = g, c.trace + tuple(trace), e, p


# The verifier tracks the last writer of every element; beyond this buffer size the search
# relies on the templates and rules (verified at small shapes in the tests) and the renderer check.
VERIFY_MAX_ELEMENTS = 1 << 23


def feasibility(g: GIRGraph, t: TargetSpec, verify: bool = True) -> str:
    """'' when the graph verifies (verify=False: not checked here) and (for C-style GPU targets)
    the renderer accepts its layouts."""
    if verify:
        reason = verification(g)
        if reason:
            return reason
    renderer = _renderer(t)
    if renderer is not None:
        return _layout_refusal(renderer, g)
    return ""


def _layout_refusal(renderer, g: GIRGraph) -> str:
    """'' where the renderer renders every kernel of `g`, else why not (its first RenderError,
    kernels in order, as rendering the whole graph reports it). Each kernel's verdict is
    remembered by what its rendering reads (renderer.render_kernel: the graph's name and
    parallel structure, the kernel's gOperators, the buffers they name): the plans of one
    search share many kernels (a template choice changes one kernel of several; Swin-T's
    search rendered 2,534 kernels, 1,752 distinct)."""
    from powerfusion.backends.source import RenderError
    per_kernel = getattr(renderer, "render_kernel", None)
    if per_kernel is None:   # a renderer that renders whole graphs only
        try:
            renderer.render(g)
        except RenderError as e:
            return f"renderer: {e}"[:300]
        return ""
    buffers = {b.name: b for b in g.buffers}
    for k, ops in enumerate(g.kernels()):
        key = _kernel_key(renderer, g, ops, buffers)
        verdict = _LAYOUTS.get(key) if key is not None else None
        if verdict is None:
            try:
                per_kernel(g, ops, k)
                verdict = ""
            except RenderError as e:
                verdict = f"renderer: {e}"[:300]
            if key is not None:
                if len(_LAYOUTS) >= LAYOUT_MEMO:
                    _LAYOUTS.clear()
                _LAYOUTS[key] = verdict
        if verdict:
            return verdict
    return ""


LAYOUT_MEMO = 4096   # kernels whose render verdict the search remembers (per process)
_LAYOUTS: dict[tuple, str] = {}


def _kernel_key(renderer, g: GIRGraph, ops, buffers: dict) -> tuple | None:
    """What rendering one kernel reads (render_kernel's docstring); None where an op names a
    buffer the graph lacks (not remembered: the renderer reports it)."""
    from powerfusion.rewrite.base import op_facts
    names = set()
    for op in ops:
        names |= op_facts(op).names   # inputs, outputs, gathered (indices, masks, guard)
    if not names <= buffers.keys():
        return None
    return type(renderer), g.name, g.parallel, ops, tuple(buffers[n] for n in sorted(names))


def verification(g: GIRGraph) -> str:
    """'' when the verifier accepts the graph (or its buffers are past VERIFY_MAX_ELEMENTS)."""
    from powerfusion.gir.verifier import GIRVerifyError, verify
    if max((b.size for b in g.buffers), default=0) <= VERIFY_MAX_ELEMENTS:
        try:
            verify(g)
        except GIRVerifyError as e:
            return f"verifier: {e}"[:300]
    return ""


# A rewritten plan whose buffers are this small is also run against its merged plan on seeded
# random inputs (the GIR interpreter, milliseconds): a numeric check beside the verifier's
# structural one. The rules' own checks once accepted a mask refit that read a ConvTranspose's
# input into its zero-stuffed rows (found only by the CUDA conformance run).
EQUIVALENCE_MAX_ELEMENTS = 1 << 16


def equivalence(optimised: GIRGraph, merged: GIRGraph) -> str:
    """'' when `optimised` computes what `merged` does on seeded random inputs (floats within
    rounding: 1e-3 relative to the output's largest magnitude, 2e-2 for 16-bit types; integers
    and booleans exactly), or when the graphs are too large to run here; else why not."""
    if optimised is merged or max((b.size for b in merged.buffers), default=0) > EQUIVALENCE_MAX_ELEMENTS:
        return ""
    import numpy as np
    from powerfusion.gir.interpreter import np_dtype, run_gir
    from powerfusion.pipeline.tune import random_inputs
    feeds = random_inputs(merged, seed=7)
    with np.errstate(all="ignore"):
        try:
            want = run_gir(merged, feeds)
        except Exception:   # these inputs are outside the graph's domain (a zero divisor): not checked
            return ""
        try:
            got = run_gir(optimised, feeds)
        except Exception as e:
            return f"rewritten plan fails where the merged plan runs: {type(e).__name__}: {e}"[:300]
    for name in merged.outputs:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        dt = np.dtype(np_dtype(merged.buffer(name).dtype))
        if dt.kind in "iub":
            same = np.array_equal(a, b)
        else:
            a, b = a.astype(np.float64), b.astype(np.float64)
            finite = np.isfinite(b)
            rtol = 2e-2 if dt.itemsize <= 2 else 1e-3
            scale = float(np.max(np.abs(b[finite]), initial=0.0))
            same = bool(np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~finite & ~np.isnan(b)], b[~finite & ~np.isnan(b)])
                        and np.all(np.abs(a[finite] - b[finite]) <= rtol * (scale + 1e-30)))
        if not same:
            return f"rewritten plan differs from the merged plan on random inputs (output {name})"
    return ""


def _verified(ranked: list[_Cand], need: int) -> tuple[list[_Cand], int]:
    """The ranked candidates less those the verifier rejects among the first `need` that pass.
    The verifier simulates every element, the search's most expensive check: it runs on the
    plans that can be picked (the best, or the top-k that tuning times), not on every plan
    rewritten. Returns (candidates, how many were rejected)."""
    out, rejected, passed = [], 0, 0
    for c in ranked:
        if passed < need:
            reason = verification(c.optimised) or equivalence(c.optimised, c.merged)
            if reason:
                c.note, rejected = reason, rejected + 1
                continue
            passed += 1
        out.append(c)
    return out, rejected


def _renderer(t: TargetSpec):
    """The renderer the search tries each candidate on, where the target's backend asks for it:
    one per backend for the process (a renderer compiles its Jinja skeletons once; a new one per
    candidate compiled them again for every plan tried)."""
    if t.backend not in _RENDERERS:
        entry = backend(t.backend)
        _RENDERERS[t.backend] = entry.load_renderer() if entry.render_in_search else None
    return _RENDERERS[t.backend]


_RENDERERS: dict = {}   # backend name -> its renderer (or None: the backend renders nothing in the search)


def optimistic_seconds(merged: GIRGraph, t: TargetSpec) -> float:
    """A cheap optimistic estimate of a plan before rewriting: as if every intermediate
    tensor stayed on chip -- only the accesses of the subgraph's interface buffers, every
    sync gone, one kernel, identical tile loads counted once, no register spills (which tiles are live together depends on how the
    rewriting splits kernels; counted here, the spills of a whole subgraph's tiles in one kernel
    made the bound of decode attention's plans 20-50x their rewritten prediction, so the beam
    pruned every alternative). Rewriting can only remove traffic, so this ranks plans by what
    their parallel structure allows (occupancy, bytes in flight, coalescing)."""
    interface = set(merged.inputs) | set(merged.outputs) | {n for n, _ in merged.constants}
    keep, loaded = [], set()
    for op in merged.ops:
        if isinstance(op.args, Sync):
            continue
        touches = [s for s in op.inputs + op.outputs if s.level == Level.GLOBAL]
        if touches and not all(s.buffer in interface for s in touches):
            continue
        reads = tuple(s for s in op.inputs if s.level == Level.GLOBAL)
        if reads and not op.outputs[0].level == Level.GLOBAL:
            if reads in loaded:   # the same tile loaded again by another basic op: rewriting merges them
                continue
            loaded.add(reads)
        keep.append(op)
    est = estimate(merged.with_ops(keep), t, spills=False)
    return predict_seconds(est, t)


class _Progress:
    """A progress bar (tqdm, powerfusion.progress) over the candidate plans of a long search."""

    def __init__(self, total: int, name: str, mode):
        from powerfusion.progress import progress_bar
        enabled = None if mode is None else bool(mode)   # None: on a terminal at verbose >= 1
        if mode is None and total < PROGRESS_MIN:
            enabled = False
        self.bar = progress_bar(total=total, desc=f"plan search {name}", unit="plan", enabled=enabled)

    def step(self) -> None:
        self.bar.update(1)

    def done(self) -> None:
        self.bar.close()
