"""One-pass statistics: rules that let a second statistic of a row share the pass that
computes the first (docs/design.md, "One-pass statistics").

A unit that reduces a long register tile twice -- the sum of x for the mean, then the sum of
(x - mean)^2 -- reads the tile twice, and where the tile is too long for registers the
renderer streams it (backends/cstyle/streaming.py): every pass is another read of the row
from DRAM (LayerNorm over 65536 elements: three reads and a write instead of one and one).

`"sum((x - m)^2) => shifted slot sums"` computes the second statistic in the first pass:
each lane slot s (one column of the num x W tile) keeps shifted sums A1 = sum(x - c_s) and
A2 = sum((x - c_s)^2), with c_s the slot's element in segment 0 (re-read from global memory),
and the unit combines the slots once the mean m is known (Chan, Golub and LeVeque's pairwise
update with equal counts):

    sum_i (x_i - m)^2 = sum_s [ A2_s - A1_s^2 / num + num * (c_s - m + A1_s / num)^2 ]

exact for any m. The shift keeps the sums near the data's spread, not its offset: the
naive sum(x^2) - n m^2 loses every digit for data of mean 1e4 and std 1 in float32; this
form stays within float32 rounding of the two-pass result (tests/rewrite/test_onepass.py).

`"max(x) ; sum(exp(x - m)) => online slot sums"` does the same for softmax: the pass that
takes each slot's max also takes `reduce(sumexp)` -- the slot's sum of exp(x - max_s), kept
with a running max that rescales it when the max grows (online softmax, one exp per element)
-- and the unit combines sum_i exp(x_i - m) = sum_s sumexp_s * exp(max_s - m). Every
exponent is a difference of two float32 values of the row (exact where they are close), so
large offsets cost nothing; a single log-sum-exp scalar would round at the offset's scale.

These rules differ from the driver's tables in one way: they do not lower modelled traffic
(the variance rule even adds a load of one segment of the tile, the shift row, `num = 1`:
1/num of the tile's load), and the softmax rule adds an exp per element; what they save --
a streamed pass over the row -- exists only where the renderer streams. So they are not applied greedily: `one_pass_variant` gives the search a second
candidate, and the cost model (which counts streamed passes) chooses (pipeline/search.py).
Preconditions are checked exactly (slice patterns, sole writers and readers, guards, no
masked elements); every application is traced.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from powerfusion.gir.expr import const, loads, substitute
from powerfusion.gir.ir import (Broadcast, Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Reduce)
from powerfusion.gir.traffic import traffic
from powerfusion.rewrite.base import (Rewrite, device_syncs_between, fresh_name, index, matches, next_uid, readers,
                                      same_guard, written_between, writers)

FLOATS = frozenset({"float32", "float64"})


def _sole_writer(g: GIRGraph, name: str, before: int) -> int | None:
    ws = writers(g, name)
    return ws[0] if len(ws) == 1 and ws[0] < before else None


def _is(op: GOp, kind, **fields) -> bool:
    return isinstance(op.args, kind) and all(getattr(op.args, k) == v for k, v in fields.items())


def _plain_register(s: MemorySlice, num: int, width: int) -> bool:
    return s.level == Level.REGISTER and s.valid is None and (s.num, s.width) == (num, width)


@dataclass(frozen=True)
class _Match:
    """The gOperators of a second statistic of a tile x in one unit, as a rule found them:
    reduce(sum, num)(f(x - m)) ; reduce(sum, width), m a scalar broadcast to the tile."""
    q: int                 # reduce(sum, num) of f(x - m) -> 1 x W
    r: int                 # reduce(sum, width) of q's partials -> 1 x 1
    term: int              # the elementwise f: mul(d, d) (variance) or exp(d) (softmax)
    diff: int              # elementwise sub(x, m_tile)
    mean_row: int          # broadcast(width) m -> 1 x W (read for the slot corrections)
    first_pass: int        # a reduce over num of x before diff: the pass the statistic joins
    x: MemorySlice         # the tile (num x W)
    row: MemorySlice       # a 1 x W slice in the identity layout of the tile's lanes


def _sum_tail(g: GIRGraph, at: int) -> tuple[int, MemorySlice, MemorySlice] | None:
    """(r, the summed tile, the partials) for reduce(sum, num) at `at` whose partials only
    reduce(sum, width) at r reads."""
    q = g.ops[at]
    if not _is(q, Reduce, fn="sum", over="num"):
        return None
    tile, part = q.inputs[0], q.outputs[0]
    if tile.num < 2 or not _plain_register(tile, tile.num, tile.width) or not _plain_register(part, 1, tile.width):
        return None
    rs = readers(g, part.buffer)
    if len(rs) != 1 or rs[0] <= at or writers(g, part.buffer) != [at] or part.buffer in index(g).interface:
        return None
    if not _is(g.ops[rs[0]], Reduce, fn="sum", over="width") or g.ops[rs[0]].inputs[0] != part:
        return None
    return rs[0], tile, part


def _find(g: GIRGraph, at: int, term_fn: str, first_fn: str | None) -> _Match | None:
    """The match at `at` whose summed tile is term_fn(d) (mul: d * d), d = x - m, x reduced
    over num before (by first_fn, or any reduction when None)."""
    tail = _sum_tail(g, at)
    if tail is None:
        return None
    r, tile, part = tail
    num, W = tile.num, tile.width
    term = _sole_writer(g, tile.buffer, at)
    if term is None or not _is(g.ops[term], Elementwise, fn=term_fn) or tile.buffer in index(g).interface:
        return None
    top = g.ops[term]
    d = top.inputs[0]
    if any(s != d for s in top.inputs) or top.outputs[0].pattern() != tile.pattern() or d.pattern() != tile.pattern():
        return None
    diff = _sole_writer(g, d.buffer, term)
    if diff is None or not _is(g.ops[diff], Elementwise, fn="sub") or len(g.ops[diff].inputs) != 2:
        return None
    x, mt = g.ops[diff].inputs
    if not (_plain_register(x, num, W) and _plain_register(mt, num, W)) or x.pattern() != d.pattern():
        return None
    mean_tile = _sole_writer(g, mt.buffer, diff)
    if mean_tile is None or not _is(g.ops[mean_tile], Broadcast, over="num"):
        return None
    mrow = g.ops[mean_tile].inputs[0]
    mean_row = _sole_writer(g, mrow.buffer, mean_tile)
    if mean_row is None or not _is(g.ops[mean_row], Broadcast, over="width"):
        return None
    if mrow.pattern() != part.pattern() or g.ops[mean_row].inputs[0].count != 1:
        return None
    first = [k for k in readers(g, x.buffer) if k < diff and _is(g.ops[k], Reduce, over="num")
             and g.ops[k].inputs[0] == x and (first_fn is None or g.ops[k].args.fn == first_fn)]
    if not first or written_between(g, x.buffer, first[0], diff):
        return None
    ops = [g.ops[k] for k in (at, r, term, diff, mean_tile, mean_row, first[0])]
    if not all(same_guard(ops[0], o) for o in ops) or device_syncs_between(g, first[0], r):
        return None   # the new slot tiles live from the first pass to r: one kernel
    dtypes = {g.buffer(s.buffer).dtype for o in ops for s in o.inputs + o.outputs if s.level == Level.REGISTER}
    if not dtypes <= FLOATS or len(dtypes) != 1:
        return None
    return _Match(at, r, term, diff, mean_row, first[0], x, part)


class _Builder:
    """New register buffers and gOperators for one rewrite (fresh names, the rule's origin)."""

    def __init__(self, g: GIRGraph, origin: str, guard, dtype: str):
        self.g, self.origin, self.guard, self.dtype = g, origin, guard, dtype
        self.buffers: list[Buffer] = []

    def reg_like(self, s: MemorySlice, stem: str) -> MemorySlice:
        taken = replace(self.g, buffers=self.g.buffers + tuple(self.buffers))
        b = Buffer(fresh_name(taken, stem), Level.REGISTER, s.count, self.dtype)
        self.buffers.append(b)
        return replace(s, buffer=b.name, level=Level.REGISTER, dtype=self.dtype)

    def op(self, args, ins, out: MemorySlice) -> GOp:
        return GOp(args, tuple(ins), (out,), self.guard, self.origin)

    def ew(self, fn: str, ins, like: MemorySlice, stem: str, **params) -> tuple[GOp, MemorySlice]:
        out = self.reg_like(like, stem)
        return GOp(Elementwise(fn, tuple(sorted(params.items()))), tuple(ins), (out,), self.guard, self.origin), out


def _row0(g: GIRGraph, tile: MemorySlice, before: int, row: MemorySlice, b: _Builder,
          ops: list[GOp], at: int, depth: int = 0) -> MemorySlice | None:
    """A 1 x W register slice holding segment 0 of `tile` as it is at `before`, computed
    again (to run at position `at`) from global memory by the tile's own writers (loads,
    elementwise ops, broadcasts of rows), appended to `ops`; None when the tile has another
    kind of writer or a source changes before `at`."""
    k = _sole_writer(g, tile.buffer, before)
    if k is None or depth > 16:
        return None
    w = g.ops[k]
    if not same_guard(w, g.ops[before]) or w.outputs[0].pattern() != tile.pattern():
        return None
    if _is(w, Broadcast, over="num"):
        src = w.inputs[0]
        ok = src.pattern() == row.pattern() and src.level == Level.REGISTER and not written_between(g, src.buffer, k, at)
        return src if ok and _sole_writer(g, src.buffer, k) is not None else None
    if isinstance(w.args, Move):
        src = w.inputs[0]
        if src.level != Level.GLOBAL or src.valid is not None or loads(src.index) or written_between(g, src.buffer, k, at):
            return None
        first = replace(src, num=1, index=substitute(src.index, {"i": const(0)}))
        out = b.reg_like(row, f"{tile.buffer}_row0")
        ops.append(b.op(Move(), [first], out))
        return out
    if isinstance(w.args, Elementwise):
        ins = []
        for s in w.inputs:
            if not _plain_register(s, tile.num, tile.width) or s.pattern() != tile.pattern():
                return None
            r0 = _row0(g, s, k, row, b, ops, at, depth + 1)
            if r0 is None:
                return None
            ins.append(r0)
        out = b.reg_like(row, f"{tile.buffer}_row0")
        ops.append(GOp(w.args, tuple(ins), (out,), b.guard, b.origin))
        return out
    return None


@matches("reduce")
def shifted_variance(g: GIRGraph, at: int) -> Rewrite | None:
    """reduce(sum, num)((x - m)^2) ; reduce(sum, width) => per-slot shifted sums of x in the
    pass that reduces x, combined per unit with m (module docstring)."""
    v = _find(g, at, "mul", None)
    if v is None or len(g.ops[v.term].inputs) != 2 or readers(g, g.ops[v.term].outputs[0].buffer) != [at]:
        return None
    num = v.x.num
    b = _Builder(g, f"onepass:{g.ops[at].origin}", g.ops[at].guard, g.buffer(v.x.buffer).dtype)
    shift_ops: list[GOp] = []
    c = _row0(g, v.x, v.first_pass, v.row, b, shift_ops, v.first_pass)
    if c is None:
        return None
    # the pass: x - c_s, its sum and its sum of squares, beside the first statistic
    ct = b.reg_like(v.x, f"{v.x.buffer}_shift")
    xs_op, xs = b.ew("sub", [v.x, ct], v.x, f"{v.x.buffer}_shifted")
    a1 = b.reg_like(v.row, f"{v.x.buffer}_shifted_sum")
    q_op, xq = b.ew("mul", [xs, xs], v.x, f"{v.x.buffer}_shifted_sq")
    a2 = b.reg_like(v.row, f"{v.x.buffer}_shifted_sqsum")
    pass_ops = [b.op(Broadcast("num"), [c], ct), xs_op, b.op(Reduce("sum", "num"), [xs], a1), q_op,
                b.op(Reduce("sum", "num"), [xq], a2)]
    # per slot: M2_s = A2 - A1^2/num, d_s = (c_s - m) + A1/num; the unit sums M2_s + num d_s^2
    mrow = g.ops[v.mean_row].outputs[0]
    m1_op, m1 = b.ew("affine", [a1], v.row, f"{v.x.buffer}_slot_mean", alpha=1.0 / num, beta=0.0)
    t_op, t = b.ew("mul", [a1, m1], v.row, f"{v.x.buffer}_slot_sq")
    m2_op, m2 = b.ew("sub", [a2, t], v.row, f"{v.x.buffer}_slot_m2")
    dc_op, dc = b.ew("sub", [c, mrow], v.row, f"{v.x.buffer}_slot_off")
    ds_op, ds = b.ew("add", [dc, m1], v.row, f"{v.x.buffer}_slot_dev")
    sq_op, sq = b.ew("mul", [ds, ds], v.row, f"{v.x.buffer}_slot_dev_sq")
    nsq_op, nsq = b.ew("affine", [sq], v.row, f"{v.x.buffer}_slot_dev_n", alpha=float(num), beta=0.0)
    tot_op, tot = b.ew("add", [m2, nsq], v.row, f"{v.x.buffer}_slot_total")
    final = replace(g.ops[v.r], inputs=(tot,), uid=0)
    combine = [m1_op, t_op, m2_op, dc_op, ds_op, sq_op, nsq_op, tot_op, final]
    new = _schedule(g, v, shift_ops, pass_ops, combine)
    uid = next_uid(g)
    new = [replace(op, uid=uid + k) if op.uid == 0 else op for k, op in enumerate(new)]
    changed = (g.ops[v.q].uid, g.ops[v.r].uid, g.ops[v.term].uid)
    return Rewrite(tuple(new), g.buffers + tuple(b.buffers), changed)


@matches("reduce")
def online_softmax(g: GIRGraph, at: int) -> Rewrite | None:
    """reduce(max, num)(x) ... reduce(sum, num)(exp(x - m)) ; reduce(sum, width) => reduce(sumexp,
    num)(x) beside the max in its pass (each slot's sum of exp(x - slot max), a running max
    rescaling it: online softmax); the unit sums sumexp_s * exp(max_s - m). Exact for any m;
    m >= max_s (the row max) keeps every factor <= 1. exp(x - m) itself stays (its readers
    -- the softmax output -- recompute it in their own pass)."""
    v = _find(g, at, "exp", "max")
    if v is None:
        return None
    slot_max = g.ops[v.first_pass].outputs[0]
    if (slot_max.pattern() != v.row.pattern() or slot_max.level != Level.REGISTER
            or _sole_writer(g, slot_max.buffer, v.r) != v.first_pass):
        return None
    b = _Builder(g, f"onepass:{g.ops[at].origin}", g.ops[at].guard, g.buffer(v.x.buffer).dtype)
    sig = b.reg_like(v.row, f"{v.x.buffer}_slot_sumexp")
    pass_ops = [b.op(Reduce("sumexp", "num"), [v.x], sig)]
    mrow = g.ops[v.mean_row].outputs[0]
    off_op, off = b.ew("sub", [slot_max, mrow], v.row, f"{v.x.buffer}_slot_off")
    sc_op, sc = b.ew("exp", [off], v.row, f"{v.x.buffer}_slot_scale")
    tot_op, tot = b.ew("mul", [sig, sc], v.row, f"{v.x.buffer}_slot_total")
    combine = [off_op, sc_op, tot_op, replace(g.ops[v.r], inputs=(tot,), uid=0)]
    new = _schedule(g, v, [], pass_ops, combine, drop_term=False)
    uid = next_uid(g)
    new = [replace(op, uid=uid + k) if op.uid == 0 else op for k, op in enumerate(new)]
    return Rewrite(tuple(new), g.buffers + tuple(b.buffers), (g.ops[v.q].uid, g.ops[v.r].uid))


def _schedule(g: GIRGraph, v: _Match, shift_ops, pass_ops, combine, drop_term: bool = True) -> list[GOp]:
    """The shift row's loads before the tile is first reduced (so the pass runs as one streamed
    loop), the new reductions right after that reduce, the slot combination where r was."""
    out: list[GOp] = []
    for k, op in enumerate(g.ops):
        if k == v.first_pass:
            out += shift_ops + [op] + pass_ops
        elif k == v.r:
            out += combine
        elif k != v.q and not (drop_term and k == v.term):
            out.append(op)
    return out


ONEPASS_RULES = {
    "sum((x - m)^2) => shifted slot sums": shifted_variance,
    "max(x) ; sum(exp(x - m)) => online slot sums": online_softmax,
}


class OnePassError(AssertionError):
    """A one-pass rule broke its invariant (a store added, more than shift rows loaded, a kernel added)."""


def _check(name: str, before: GIRGraph, after: GIRGraph) -> None:
    old = {id(op) for op in before.ops}
    added = [op for op in after.ops if id(op) not in old]
    if any(s.level == Level.GLOBAL for op in added for s in op.outputs):
        raise OnePassError(f"one-pass rule '{name}' added a global store on {before.name}")
    if any(s.level == Level.GLOBAL and s.num != 1 for op in added for s in op.inputs):
        raise OnePassError(f"one-pass rule '{name}' loads more than a shift row on {before.name}")
    if len(after.kernels()) > len(before.kernels()):
        raise OnePassError(f"one-pass rule '{name}' added a kernel on {before.name}")


def apply_one_pass(graph: GIRGraph, rules: dict | None = None) -> tuple[GIRGraph, list]:
    """Apply the one-pass rules wherever they match (each application removes the second
    pass it matched, so this ends); returns the graph and the trace of every application."""
    from powerfusion.rewrite.driver import TraceStep
    rules = ONEPASS_RULES if rules is None else rules
    g, trace = graph, []
    for _ in range(len(graph.ops) + 1):
        hit = next(((name, rw) for at, op in enumerate(g.ops) for name, rule in rules.items()
                    if op.kind in rule.kinds and (rw := rule(g, at)) is not None), None)
        if hit is None:
            return g, trace
        name, rw = hit
        new = rw.apply(g)
        _check(name, g, new)
        trace.append(TraceStep(name, g, new, rw.changed))
        g = new
    raise OnePassError(f"one-pass rewriting of {graph.name} did not end")


def one_pass_variant(optimised: GIRGraph) -> tuple[GIRGraph, list] | None:
    """The one-pass form of an optimised graph, cleaned up by the driver's rules (the squared
    deviations a rule leaves unread go), with the trace of both; None where no rule applies."""
    from powerfusion.rewrite.driver import optimise
    g, trace = apply_one_pass(optimised)
    if not trace:
        return None
    out, more = optimise(g)
    return out, trace + more


def global_bytes(g: GIRGraph) -> int:
    return traffic(g)["global"]
