"""Lower one memory-bound subgraph to one GIR graph: one template candidate per basic op,
merged in topological order (docs/design.md, "The pipeline").

* Tensors keep their sanitised names as GLOBAL buffers. A Reshape whose output stays
  inside the subgraph is an alias of its input's buffer (no gOperator); otherwise it is
  a copy template.
* Between the ops that write a tensor and each later op that reads it, a DEVICE Sync:
  inputs = the slices as written, outputs = the slices as read. The rewrite rules decide
  (by sync scope) whether the data can stay in registers and the sync can go.
* Differing parallel structures: the merged Parallel has the largest unit count; the
  gOperators of a template with fewer units carry `guard = u < its units` (combined with
  their own guard). Syncs stay unguarded (every unit reaching a barrier is harmless).
  Every template uses the same group size (templates.common.UNITS_PER_GROUP), so
  SHARED indexing and BLOCK syncs keep their meaning; a choice mixing group sizes is
  rejected, since re-grouping would change which units share memory.
* The default choice picks, per op, the candidate whose accesses of its neighbours'
  tensors line up with theirs -- every element read by the unit and lane that wrote it
  (sync scope LANE; tested on a sample of units) -- so that the rewrite rules can fuse: a
  forward pass matching producers, then sweeps matching producers and consumers; ties go
  to equal per-unit tiles, then to the template's own order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from powerfusion.errors import PowerFusionError
from powerfusion.basic import BasicGraph, Reshape, Subgraph
from powerfusion.gir.expr import U, loads
from powerfusion.gir.ir import GIRGraph, GOp, Level, Parallel, Scope, Sync, units_key
from powerfusion.templates import candidates as node_candidates
from powerfusion.templates.common import Candidate, Ctx, and_, buffer_names, resolve_target, sanitize



class LowerError(PowerFusionError):
    """A subgraph cannot be lowered with the given template choice."""


# ---- naming and candidates ------------------------------------------------------------

class MergePlan:
    """Per-subgraph lowering context: buffer names, aliases, candidate lists."""

    def __init__(self, sub: Subgraph, graph: BasicGraph, target):
        self.sub, self.graph, self.target = sub, graph, resolve_target(target)
        tensors = list(dict.fromkeys(t for n in sub.nodes for t in n.inputs + n.outputs))
        stem = sanitize(sub.name) + "_"
        self.names = buffer_names(tensors, reserved=stem)
        outs = set(sub.outputs)
        self.alias: dict[str, str] = {}
        for n in sub.nodes:  # a reshape inside the subgraph is a new name for the same buffer
            if isinstance(n.op, Reshape) and n.outputs[0] not in outs:
                self.names[n.outputs[0]] = self.names[n.inputs[0]]
                self.alias[n.outputs[0]] = n.inputs[0]
        self.nodes = [n for n in sub.nodes if n.outputs[0] not in self.alias]
        self._cands: dict[str, list[Candidate]] = {}
        # (id producer, id consumer, buffer) -> (lines up, same tiles, producer, consumer): the
        # candidates are held so that their ids stay theirs while the entry lives
        self.memo: dict[tuple, tuple] = {}
        self.sides: dict[tuple, tuple] = {}   # (id candidate, buffer, write) -> (_Side, candidate)
        self.default: dict[str, Candidate] | None = None   # _best_descent without fixed choices
        self.descents: dict[tuple, dict[str, Candidate]] = {}   # (sweeps, family) -> unconstrained _descend
        # (node, both, family, id current, ids and buffers of the neighbours' choices) -> the pick
        # of _descend_from, with the candidates it names (held: their ids stay theirs)
        self.picks: dict[tuple, tuple] = {}

    def candidates(self, node) -> list[Candidate]:
        if node.name not in self._cands:
            cs = node_candidates(node, self.graph.tensors, self.target, self.names, sanitize(self.sub.name))
            if not cs:
                o = node.origin
                raise LowerError(f"no GIR template fits basic op {node.name} (node '{o.node}', {o.op_type}, "
                                 f"opset {o.opset}, shapes {[self.graph.tensors[t].shape for t in node.inputs]})")
            self._cands[node.name] = cs
        return self._cands[node.name]

    def rebind(self, node, c: Candidate) -> Candidate:
        """The same template and parameters under this plan's names."""
        ctx = Ctx(node, self.graph.tensors, self.target, self.names, sanitize(self.sub.name))
        if c.ctx.names == ctx.names and c.ctx.prefix == ctx.prefix and c.ctx.target == ctx.target:
            return c
        return Candidate(c.name, c.params, ctx, c.builder)

    def match(self, p: Candidate, c: Candidate, buffer: str) -> tuple[bool, bool]:
        """(lines_up, same_tiles) for producer p and consumer c of `buffer`, memoised."""
        key = (id(p), id(c), buffer)
        hit = self.memo.get(key)
        if hit is None:
            ws, rs = self.side(p, buffer, True), self.side(c, buffer, False)
            hit = self.memo[key] = (_lines_up_shared(p, c, buffer, ws, rs), bool(ws.tiles) and ws.tiles == rs.tiles,
                                    p, c)
        return hit[0], hit[1]

    def side(self, cand: Candidate, buffer: str, write: bool) -> "_Side":
        """The candidate's stores (write) or loads of `buffer`, with their memo key, once per
        candidate: every pairing with the other op's candidates looks at the same accesses."""
        key = (id(cand), buffer, write)
        hit = self.sides.get(key)
        if hit is None:
            hit = self.sides[key] = (_side(cand, buffer, write), cand)
        return hit[0]

    def internal_edges(self):
        """(producer node, consumer node, buffer) for tensors made and used inside the subgraph."""
        made = {}
        for n in self.nodes:
            for t in n.outputs:
                made[self.names[t]] = n
        for n in self.nodes:
            for t in dict.fromkeys(n.inputs):
                b = self.names[t]
                if b in made and made[b] is not n:
                    yield made[b], n, b


# ---- matching --------------------------------------------------------------------------

def _accesses(g: GIRGraph, buffer: str, write: bool):
    out = []
    for op in g.ops:
        if isinstance(op.args, Sync):
            continue
        for s in (op.outputs if write else op.inputs):
            if s.buffer == buffer and s.level == Level.GLOBAL:
                out.append((s, op.active_units(g.parallel.units)))
    return out


HUGE_TILE = 1 << 16   # elements per unit


def lines_up(producer: Candidate, consumer: Candidate, buffer: str, sample: int = 8) -> bool:
    """Every element of `buffer` the consumer reads is read by the unit and lane that wrote it.
    A heuristic for the choice, so it looks at a sample of units only: the first and last
    reader units and a seeded random few; for each, the (address, lane) pairs it reads must be
    among those it wrote itself (every element of an internal tensor is written by someone)."""
    gp, gc = producer.build(), consumer.build()
    if gp.parallel.lanes != gc.parallel.lanes or gp.parallel.units_per_group != gc.parallel.units_per_group:
        return False
    ws, rs = _accesses(gp, buffer, True), _accesses(gc, buffer, False)
    if not ws or not rs:
        return False
    if all(w.pattern() == r.pattern() and (wu is ru or np.array_equal(wu, ru)) for w, wu in ws for r, ru in rs):
        return True
    biggest = max(x.count for x, _ in ws + rs)
    if biggest > HUGE_TILE:
        return False   # a tile this large spills whatever lines up; not worth an expensive check
    readers = _sample_units([ru for _, ru in rs], max(4, min(sample, (1 << 17) // max(biggest, 1))))
    lanes = gp.parallel.lanes
    if len(ws) == 1 and len(rs) == 1:
        if _same_elements(ws[0], rs[0], readers):
            return True
        if not _within_range(ws[0], rs[0], readers[:1]):
            return False
    if len(readers) > 1 and not _keys_line_up(ws, rs, readers[len(readers) // 2:][:1], lanes):
        return False   # one unit's reads not among its writes: most pairs of candidates fail here
    return _keys_line_up(ws, rs, readers, lanes)


def _keys_line_up(ws, rs, readers: np.ndarray, lanes: int) -> bool:
    """Every (unit, address, lane) that the `readers` read is one they wrote. The keys carry the
    unit, so the test holds for a set of units exactly when it holds for each of them: a failing
    subset decides the whole sample (lines_up tries one unit first, cheaply)."""
    if any(_slice_loads(x) for x, _ in ws + rs):
        return False  # data-dependent addresses never line up
    # accesses none of the readers runs add no keys (a concat's writers each cover a few units)
    wk = [_keys(w, m, lanes) for w, wu in ws if (m := _members(readers, wu)).size] or [np.zeros(0, np.int64)]
    rk = [_keys(r, m, lanes) for r, ru in rs if (m := _members(readers, ru)).size] or [np.zeros(0, np.int64)]
    w, r = np.concatenate(wk), np.concatenate(rk)
    if w.size > 1 and not np.all(w[1:] >= w[:-1]):  # row-major writes come out sorted already
        w = np.sort(w)
    if w.size == 0:
        return r.size == 0
    return bool(np.all(w[np.minimum(np.searchsorted(w, r), w.size - 1)] == r))


@dataclass(frozen=True)
class _Side:
    """One candidate's GLOBAL stores or loads of a buffer, as lines_up and same_tiles see them."""
    accesses: tuple                # (slice, active units) per access
    lanes: int
    units_per_group: int
    data_dependent: bool           # a slice's index or validity loads data: not memoised across candidates
    key: int                       # interned (slices less the buffer's name, unit-set keys)
    tiles: frozenset               # {(num, width)} of the accesses


def _side(cand: Candidate, buffer: str, write: bool) -> _Side:
    g = cand.build()
    acc = tuple(_accesses(g, buffer, write))
    loaded = any(_slice_loads(x) for x, _ in acc)
    key = -1 if loaded else _intern(tuple((replace(x, buffer=""), units_key(u)) for x, u in acc))
    return _Side(acc, g.parallel.lanes, g.parallel.units_per_group, loaded, key,
                 frozenset((s.num, s.width) for s, _ in acc))


def _intern(key: tuple) -> int:
    """A small int for an access key (hashing the slices' expression trees again for every
    pairing cost more than the pairing's own check)."""
    hit = _SIDE_IDS.get(key)
    if hit is None:
        if len(_SIDE_IDS) >= 1 << 15:
            _SIDE_IDS.clear()     # ids are never reused (the counter runs on): old memo keys just miss
        hit = _SIDE_IDS[key] = next(_SIDE_COUNTER)
    return hit


_SIDE_IDS: dict[tuple, int] = {}
_SIDE_COUNTER = itertools.count()


def _lines_up_shared(producer: Candidate, consumer: Candidate, buffer: str, ws: _Side, rs: _Side) -> bool:
    """lines_up, memoised across candidates, plans and subgraphs by what it looks at: the
    parallel structures and the accesses of the buffer (slices with the buffer's name left
    out, and their units). Candidates of different ops and repeated layers share most edges."""
    if ws.data_dependent or rs.data_dependent:
        return lines_up(producer, consumer, buffer)
    key = (ws.lanes, ws.units_per_group, rs.lanes, rs.units_per_group, ws.key, rs.key)
    hit = _LINES_UP.get(key)
    if hit is None:
        if len(_LINES_UP) >= 1 << 14:
            _LINES_UP.clear()
        hit = _LINES_UP[key] = lines_up(producer, consumer, buffer)
    return hit


_LINES_UP: dict[tuple, bool] = {}


def _slice_loads(s) -> bool:
    return bool(loads(s.index)) or (s.valid is not None and bool(loads(s.valid)))


def _same_elements(w, r, readers) -> bool:
    """Cheap sufficient test: on the sampled units both slices touch the same addresses at the
    same positions with the same lane layout (patterns that differ only in how they are written)."""
    (ws, wu), (rs, ru) = w, r
    if (ws.num, ws.width, ws.vec) != (rs.num, rs.width, rs.vec) or loads(ws.index) or loads(rs.index):
        return False
    if (ws.valid is not None and loads(ws.valid)) or (rs.valid is not None and loads(rs.valid)):
        return False
    units = _members(readers, ru)
    if not np.array_equal(units, _members(readers, wu)):
        return False
    rm = rs.mask(units)
    return bool(np.all(ws.mask(units)[rm]) and np.array_equal(ws.addresses(units)[rm], rs.addresses(units)[rm]))


def _within_range(w, r, units) -> bool:
    """Cheap necessary test: a unit's reads lie within the address range it wrote."""
    (ws, wu), (rs, ru) = w, r
    units = _members(units, ru)
    if units.size == 0 or loads(ws.index) or loads(rs.index):
        return True
    if _members(units, wu).size != units.size:
        return False
    wa, ra = ws.addresses(units)[ws.mask(units)], rs.addresses(units)[rs.mask(units)]
    return ra.size == 0 or (wa.size > 0 and wa.min() <= ra.min() and ra.max() <= wa.max())


def _sample_units(unit_sets: list[np.ndarray], sample: int) -> np.ndarray:
    """A few reader units (first, last and seeded random ones) without sorting millions of ids:
    active-unit arrays are already sorted and unique. Read-only: remembered by the unit sets
    (a fresh seeded generator per line-up question cost more than the question's own check)."""
    key = (sample, tuple(units_key(u) for u in unit_sets))
    hit = _SAMPLED.get(key)
    if hit is None:
        if len(_SAMPLED) >= 1 << 12:
            _SAMPLED.clear()
        hit = _SAMPLED[key] = _sample_of(unit_sets, sample)
        hit.flags.writeable = False
    return hit


_SAMPLED: dict[tuple, np.ndarray] = {}


def _sample_of(unit_sets: list[np.ndarray], sample: int) -> np.ndarray:
    picks = []
    rng = np.random.default_rng(sum(len(u) for u in unit_sets))
    for u in unit_sets:
        if len(u) <= sample:
            picks.append(u)
        else:
            picks.append(np.concatenate([u[:2], u[-2:], rng.choice(u, sample - 4, replace=False)]))
    return np.unique(np.concatenate(picks))


def _members(small: np.ndarray, sorted_units: np.ndarray) -> np.ndarray:
    """The elements of `small` that occur in the sorted array `sorted_units`."""
    if sorted_units.size == 0:
        return small[:0]
    at = np.minimum(np.searchsorted(sorted_units, small), sorted_units.size - 1)
    return small[sorted_units[at] == small]


def _keys(s, units, lanes):
    """One int64 per valid element: (unit, address, lane)."""
    if loads(s.index) or (s.valid is not None and loads(s.valid)):
        return None
    a, m = s.addresses(units), s.mask(units)
    lane = np.broadcast_to(s.lanes_of(lanes)[None, :], a.shape)
    u = np.broadcast_to(np.asarray(units, dtype=np.int64)[:, None], a.shape)
    return ((u << 40) + a * (lanes + 1) + lane)[m]


def same_tiles(producer: Candidate, consumer: Candidate, buffer: str) -> bool:
    """The producer's stores and the consumer's loads of `buffer` have the same num x width."""
    ws = {(s.num, s.width) for s, _ in _accesses(producer.build(), buffer, True)}
    rs = {(s.num, s.width) for s, _ in _accesses(consumer.build(), buffer, False)}
    return bool(ws) and ws == rs


def _descend(plan: MergePlan, fixed: dict[str, Candidate] | None = None, sweeps: int = 2,
             family: tuple | None = None) -> dict[str, Candidate]:
    """Coordinate descent over the ops' candidates, maximising lined-up edges. `family`
    (vector width, units per row) breaks the remaining ties towards candidates of that family,
    so a chain whose edges nothing decides (a reduce's per-row result feeding a broadcast)
    stays one family instead of switching mid-chain (which lines nothing up at the switch)."""
    if not fixed:   # the same unconstrained descent serves the default choice and the family plans
        key = (sweeps, family)
        if key not in plan.descents:
            plan.descents[key] = _descend_from(plan, {}, sweeps, family)
        return dict(plan.descents[key])
    return _descend_from(plan, fixed, sweeps, family)


def _descend_from(plan: MergePlan, fixed: dict[str, Candidate], sweeps: int, family: tuple | None) -> dict[str, Candidate]:
    # the edges each node takes part in, in edge order (scoring a node looks at these only)
    edges: dict[int, list] = {}
    for e in plan.internal_edges():
        edges.setdefault(id(e[0]), []).append(e)
        if e[1] is not e[0]:
            edges.setdefault(id(e[1]), []).append(e)

    match = plan.match
    choice: dict[str, Candidate] = {}
    fam: dict[int, int] = {}   # id(candidate) -> _family_score (candidates outlive the descent)

    def neighbours(node, both: bool) -> tuple[list, list]:
        """The chosen candidates at the node's edges, as (producer, buffer) for edges into it and
        (consumer, buffer) for edges out of it (with `both`): fixed while one node is picked."""
        ins, outs = [], []
        for p, c, b in edges.get(id(node), ()):
            if c is node and p.name in choice:
                ins.append((choice[p.name], b))
            if both and p is node and c.name in choice:
                outs.append((choice[c.name], b))
        return ins, outs

    def score(cand, ins, outs) -> tuple[int, int, bool]:
        """(edges lined up, edges with equal per-unit tiles, preferred width): the second breaks
        ties towards structurally similar neighbours where nothing lines up (moves then compose
        cleanly), the third towards one vector width for the whole chain."""
        s = t = 0
        for other, b in ins:
            m, st = match(other, cand, b)
            s, t = s + m, t + st
        for other, b in outs:
            m, st = match(cand, other, b)
            s, t = s + m, t + st
        if family is None:
            return s, t, False
        f = fam.get(id(cand))   # a candidate's family score, once per descent
        if f is None:
            f = fam[id(cand)] = _family_score(cand, family)
        return s, t, f

    def pick(node, both):
        if node.name in fixed:
            return plan.rebind(node, fixed[node.name])
        cs = plan.candidates(node)
        cur = choice.get(node.name, cs[0])
        ins, outs = neighbours(node, both)   # looked up once, not once per candidate
        # a pick depends only on these: descents with other fixed ops (the search's polish, the
        # plan enumeration) meet the same neighbourhoods again and again
        key = (node.name, both, family, id(cur), tuple((id(o), b) for o, b in ins),
               tuple((id(o), b) for o, b in outs))
        hit = plan.picks.get(key)
        if hit is not None:
            return hit[0]
        best, best_s = cur, score(cur, ins, outs)
        for c in cs:
            if c is cur:
                continue
            s = score(c, ins, outs)
            if s > best_s:
                best, best_s = c, s
        plan.picks[key] = (best, cur, ins, outs)   # holds the candidates: their ids stay theirs
        return best

    for n in plan.nodes:
        choice[n.name] = pick(n, False)
    for _ in range(sweeps):
        changed = False
        for n in list(reversed(plan.nodes)) + plan.nodes:
            c = pick(n, True)
            changed |= c is not choice[n.name]
            choice[n.name] = c
        if not changed:
            break
    return choice


def default_choice(subgraph: Subgraph, graph: BasicGraph, target="cuda") -> dict[str, Candidate]:
    return _best_descent(MergePlan(subgraph, graph, target))


FLAT = 0   # the "units per row" of the flat family: a unit per warp-wide run of the flat tensor


def _per_row(c: Candidate) -> int | None:
    """Units per row of a row-wise candidate (None: not row-wise). The depthwise stencil over
    flattened planes counts as FLAT: its units line up with chunk maps of one segment (the
    BatchNorm and activation after it), which no rows family prefers."""
    p = c.params
    if getattr(p, "layout", None) == "flat":
        return FLAT
    if getattr(p, "kind", None) == "rows":
        return p.per_row
    style = getattr(p, "style", None)
    return {"row_warp": 1, "block": getattr(p, "group", 0) or c.ctx.upg}.get(style)


def _family_score(c: Candidate, family: tuple) -> int:
    vec, per_row = family
    mine = _per_row(c)
    if per_row == FLAT and getattr(c.params, "kind", None) == "chunk" and c.params.num == 1:
        mine = FLAT
    return (getattr(c.params, "vec", None) == vec) + 2 * (per_row is not None and mine == per_row)


def _families(plan: MergePlan) -> list[tuple]:
    """(vector width, units per row) pairs the candidates offer: the widest vector with every
    units-per-row first (one unit per row first), then narrower vectors: the search rewrites the
    families in this order, so a time budget cut short still compares the parallel structures."""
    cs = [c for n in plan.nodes for c in plan.candidates(n)]
    ws = sorted({w for c in cs if isinstance(w := getattr(c.params, "vec", None), int)}, reverse=True)
    rows = sorted({r for c in cs if (r := _per_row(c)) is not None})
    return [(w, r) for w in ws for r in rows or [None]]


def _lined_up(plan: MergePlan, choice: dict[str, Candidate]) -> int:
    return sum(plan.match(choice[p.name], choice[c.name], b)[0] for p, c, b in plan.internal_edges())


def _best_descent(plan: MergePlan, fixed: dict[str, Candidate] | None = None, sweeps: int = 2) -> dict[str, Candidate]:
    """The descent with the most lined-up edges over the family preferences (ties: the first
    family of `_families`, then no preference)."""
    best, best_n = None, -1
    for f in _families(plan) + [None]:
        ch = _descend(plan, fixed, sweeps, family=f)
        n = _lined_up(plan, ch)
        if n > best_n:
            best, best_n = ch, n
    return best


def lowering_context(subgraph: Subgraph, graph: BasicGraph, target="cuda") -> MergePlan:
    """Names, candidates and the memo of matched edges for one subgraph: passed to
    enumerate_plans and lower_subgraph, the search lowers every plan without matching the same
    producer/consumer pair twice."""
    return MergePlan(subgraph, graph, target)


def _default_descent(plan: MergePlan) -> dict[str, Candidate]:
    if plan.default is None:
        plan.default = _best_descent(plan)
    return dict(plan.default)


def enumerate_plans(subgraph: Subgraph, graph: BasicGraph, target="cuda",
                    limit: int = 16, ctx: MergePlan | None = None) -> list[dict[str, Candidate]]:
    """Template choices for the perf-model search: the default first, then for every op and
    every other candidate of it, the plan with that candidate fixed and the rest re-matched
    around it (so whole families -- all row-per-unit, all column-wise -- appear). Deduplicated.
    `ctx`: a lowering_context of the same subgraph, graph and target to share."""
    plan = ctx or MergePlan(subgraph, graph, target)
    plans, seen = [], set()

    def add(ch):
        key = tuple(ch[n.name].label for n in plan.nodes)
        if key not in seen:
            seen.add(key)
            plans.append(ch)
    add(_default_descent(plan))
    for f in _families(plan):
        add(_descend(plan, family=f))
    # alternatives round-robin over the ops (every op's second candidate before any op's
    # third), so a late op's alternatives are reached within the limit too
    lists = [(n, plan.candidates(n)) for n in plan.nodes]
    for rank in range(max((len(cs) for _, cs in lists), default=0)):
        for n, cs in lists:
            if rank >= len(cs):
                continue
            if len(plans) >= limit:
                return plans
            add(_descend(plan, {n.name: cs[rank]}, sweeps=1))
    return plans[:limit]


# ---- merging ---------------------------------------------------------------------------

def lower_subgraph(subgraph: Subgraph, graph: BasicGraph, choice: dict | None = None, target="cuda",
                   ctx: MergePlan | None = None) -> GIRGraph:
    """One GIR graph for the subgraph: one candidate per op (default_choice where not given).
    `ctx`: a lowering_context of the same subgraph, graph and target to share."""
    plan = ctx or MergePlan(subgraph, graph, target)
    given = {n.name: choice[n.name] for n in plan.nodes if choice and n.name in choice}
    if choice and len(given) == len(plan.nodes):
        chosen = {n.name: plan.rebind(n, given[n.name]) for n in plan.nodes}
    elif not given:
        chosen = _default_descent(plan)
    else:  # the ops not named are matched around the named ones
        chosen = _best_descent(plan, given)
    parts = [(n, chosen[n.name], chosen[n.name].build()) for n in plan.nodes]
    return merge(plan, parts)


def merge(plan: MergePlan, parts) -> GIRGraph:
    sub, graph = plan.sub, plan.graph
    if not parts:
        raise LowerError(f"subgraph {sub.name} has nothing to compute (only aliases)")
    lanes = {g.parallel.lanes for _, _, g in parts}
    groups = {g.parallel.units_per_group for _, _, g in parts if _uses_groups(g)} or \
             {parts[0][2].parallel.units_per_group}
    if len(lanes) != 1 or len(groups) != 1:
        raise LowerError(f"subgraph {sub.name}: templates disagree on lanes {sorted(lanes)} or group size "
                         f"{sorted(groups)}")
    P = Parallel(max(g.parallel.units for _, _, g in parts), groups.pop(), lanes.pop())
    buffers: dict[str, object] = {}
    ops: list[GOp] = []
    writes: dict[str, list] = {}   # buffer -> slices as written so far
    def syncs(node, mine, names):
        for b in names:
            if b in writes:
                reads = [s for op in mine if not isinstance(op.args, Sync) for s in op.inputs if s.buffer == b]
                ops.append(GOp(Sync(Scope.DEVICE), tuple(writes[b]), tuple(reads), origin=f"merge:{node.name}"))

    for before, (node, cand, g) in _sources_late(parts, graph.constants):
        mine = _guarded(g.ops, g.parallel.units, P.units)
        names = list(dict.fromkeys(plan.names[t] for t in node.inputs))
        if before:   # the consumer's syncs on earlier kernels go before its late sources
            syncs(node, mine, [b for b in names if b in writes])
            names = [b for b in names if b not in writes]
        for pnode, _, pg in before + [(node, cand, g)]:
            for b in pg.buffers:
                old = buffers.setdefault(b.name, b)
                if old != b:
                    raise LowerError(f"subgraph {sub.name}: buffer '{b.name}' declared differently by two "
                                     f"templates ({old} vs {b})")
            pmine = mine if pnode is node else _guarded(pg.ops, pg.parallel.units, P.units)
            syncs(pnode, pmine, names if pnode is node else dict.fromkeys(plan.names[t] for t in pnode.inputs))
            ops.extend(pmine)
            for op in pmine:
                if not isinstance(op.args, Sync):
                    for s in op.outputs:
                        if s.level == Level.GLOBAL:
                            writes.setdefault(s.buffer, []).append(s)
    consts = [t for t in sub.inputs if t in graph.constants]
    inputs = tuple(dict.fromkeys(plan.names[t] for t in sub.inputs if t not in graph.constants))
    outputs = tuple(dict.fromkeys(plan.names[t] for t in sub.outputs))
    constants = tuple((plan.names[t], np.asarray(graph.constants[t])) for t in consts)
    for t in consts:
        buffers.setdefault(plan.names[t], _global_buffer(plan, t))
    templates = tuple((node.name, cand.label) for node, cand, _ in parts)
    return GIRGraph(sanitize(sub.name), P, tuple(buffers.values()), tuple(ops), inputs, outputs, constants, templates)


def _sources_late(parts, constants) -> list[tuple[list, tuple]]:
    """The parts as (late sources, part) in a topological order where an op reading only
    constants (a scalar constant broadcast for a Mul) comes just before its first consumer,
    after the consumer's DEVICE syncs, not where the ONNX order put it: placed early, it lands
    in an earlier kernel and its tile goes through global memory."""
    late: dict[str, tuple] = {}      # output tensor -> deferred part
    out, placed = [], set()
    for part in parts:
        node = part[0]
        if node.inputs and all(t in constants for t in node.inputs):
            for t in node.outputs:
                late[t] = part
            continue
        before = []
        for t in node.inputs:
            p = late.pop(t, None)
            if p is not None and p[0].name not in placed:
                before.append(p)
                placed.add(p[0].name)
        out.append((before, part))
        placed.add(node.name)
    for part in late.values():   # consumed by nothing inside: subgraph outputs
        if part[0].name not in placed:
            out.append(([], part))
            placed.add(part[0].name)
    return out


def _global_buffer(plan: MergePlan, t: str):
    from powerfusion.gir.ir import Buffer
    info = plan.graph.tensors[t]
    return Buffer(plan.names[t], Level.GLOBAL, max(info.size, 1), np.dtype(info.dtype).name)


def _uses_groups(g: GIRGraph) -> bool:
    return any(b.level == Level.SHARED for b in g.buffers) or any(
        isinstance(op.args, Sync) and op.args.scope == Scope.BLOCK for op in g.ops)


def _guarded(ops: Iterable[GOp], units: int, total: int) -> list[GOp]:
    if units >= total:
        return list(ops)
    return [op if isinstance(op.args, Sync) else replace(op, guard=and_(U.lt(units), op.guard)) for op in ops]


def templates_of(gir: GIRGraph) -> list[tuple[str, str]]:
    """(basic node, template with parameters) per op of the subgraph, for reports."""
    return list(gir.templates)
