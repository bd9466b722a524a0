"""Cost model of a GIR graph: `estimate(graph, target) -> Estimate`, `predict_seconds`.

Each kernel (the schedule split at DEVICE syncs) is analysed once for the limits every
gOperator in it shares -- registers per lane, shared memory per group, hence resident
units per SM and how many of the graph's units run at once -- and each gOperator then
gets a small `Estimate` (bytes per level, FLOPs, syncs, and the seconds they cost under
those limits). Estimates add up; `predict_seconds` turns the sum into one figure:

    launches * launch + max(memory, compute) + syncs + exposed latency

Memory time per gOperator, global level: global memory is a pipe with a latency
(Little's law): resident units x bytes each has in flight / latency, capped at the
achievable bandwidth (and at a per-SM share when few SMs have work). Bytes are the DRAM
footprint: a buffer read again within one kernel (gamma of a LayerNorm, re-read rows)
is served by the cache when it fits there. Uncoalesced accesses are charged as extra
cache transactions (sampled: the sectors one warp access touches vs the minimum).
Shared level: bytes x bank-conflict degree over the shared bandwidth of the SMs in use.
Register traffic is counted but costs nothing (it is what the rewrites aim for).
Compute: elementwise FLOPs from powerfusion.scalar, reductions (with the lanes'
shuffles) at the vector rate of the SMs in use, derated when few warps can issue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

from powerfusion.targets.registry import backend
from powerfusion.gir.expr import affine_coefficient, evaluate, loads
from powerfusion.gir.ir import Elementwise, GIRGraph, GOp, Level, MemorySlice, Parallel, Reduce, Scope, Sync
from powerfusion.gir.traffic import _elements, _itemsize, _units
from powerfusion.perfmodel.index_cost import lane_uniform, slice_index_ops
from powerfusion.targets.specs import MemorySystem, Occupancy, TargetSpec, get_target

ILP_CAP = 16         # independent loads a lane keeps in flight (unrolled loops; registers bound it)
LOOP_ILP = 4         # nvcc unrolls a simple loop by 4
ISSUE_WARPS = 8      # resident warps per SM needed to keep the ALUs busy
PER_SM_SHARE = 4.0   # one SM can pull at most this multiple of its even share of cache bandwidth
SUMEXP_FLOPS = 12    # reduce(sumexp) per element: an exp (scalar.py counts 8), compares, an add
# a WARP exchange (store to shared memory, sync, load back in another lane layout) is a
# dependent step in every unit's path: exposed once per kernel, like a memory phase, at this
# fraction of the memory latency (a BLOCK barrier after staged global loads is charged as a
# phase below already; charging it here too moved ConvNeXt's 14x14 / 28x28 depthwise convs off
# the stencil that measured fastest, benchmarks/results/gir-dwconv.md). Measured on the H200 (GPT-2 / ViT-B/16 fp16 residual +
# LayerNorm over 128-197 rows of 768, benchmarks/results/perfmodel-accuracy.md): plans with
# 0 / 2 / 3 / 4 such exchanges ran 3.4 / 4.05 / 4.2-4.9 / 4.6 us, ~0.3 us each, where the
# model had charged 0.01 us and picked a 2-exchange plan over the plan without any.
EXCHANGE_LATENCY = 0.6
# integer instructions (address and mask arithmetic, index_cost.py) issue at this multiple of
# the fp32 FMA instruction rate. Fitted on the H200 against the channel shuffle's measured plan
# space (benchmarks/results/perfmodel-accuracy-shuffle.md): at 0.5 (INT32 on 64 of an SM's 128
# lanes per clock) the four plans bound by per-element div/mod measured 0.34-0.69 of their
# prediction (median ~0.5); sm_90 also issues IMAD on the FMA pipe, and nvcc shares some of the
# arithmetic between the unrolled elements, so 1.0.
INT_RATE = 1.0
_DEFAULT_OCC = Occupancy(1 << 20, 1 << 20, 1 << 40, 1 << 20, 1 << 40, 1 << 40, 0)  # no residency limits modelled


@dataclass(frozen=True, slots=True)
class Estimate:
    bytes_by_level: tuple[tuple[str, float], ...] = ()   # modelled bytes (global: DRAM footprint)
    flops: float = 0.0
    syncs: tuple[tuple[str, int], ...] = ()              # scope -> gOperators
    launches: int = 0
    memory_s: float = 0.0
    compute_s: float = 0.0
    sync_s: float = 0.0
    latency_s: float = 0.0                               # exposed memory latency (dependent phases)
    limits: tuple[str, ...] = ()                         # what bounds the kernels (for reports)
    infeasible: str = ""                                 # why the plan cannot run ("" = it can)

    def __add__(self, other: "Estimate") -> "Estimate":
        return Estimate(_add_pairs(self.bytes_by_level, other.bytes_by_level), self.flops + other.flops,
                        _add_pairs(self.syncs, other.syncs), self.launches + other.launches,
                        self.memory_s + other.memory_s, self.compute_s + other.compute_s,
                        self.sync_s + other.sync_s, self.latency_s + other.latency_s,
                        tuple(dict.fromkeys(self.limits + other.limits)),
                        "; ".join(x for x in (self.infeasible, other.infeasible) if x))

    def bytes(self, level: str) -> float:
        return dict(self.bytes_by_level).get(level, 0.0)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["bytes_by_level"], d["syncs"] = dict(self.bytes_by_level), dict(self.syncs)
        d["limits"] = list(self.limits)
        return d


def _add_pairs(a, b):
    out = dict(a)
    for k, v in b:
        out[k] = out.get(k, 0) + v
    return tuple(sorted(out.items()))


def predict_seconds(est: Estimate, target: TargetSpec | str) -> float:
    t = get_target(target) if isinstance(target, str) else target
    if est.infeasible:
        return math.inf
    return est.launches * t.launch_s + max(est.memory_s, est.compute_s) + est.sync_s + est.latency_s


def estimate(graph: GIRGraph, target: TargetSpec | str, *, spills: bool = True) -> Estimate:
    """spills=False leaves out the register-spill term and caps registers per lane at a streamed
    kernel's (the search's optimistic bound: which tiles end up live together, and whether
    they stream, depends on how rewriting splits kernels)."""
    t = get_target(target) if isinstance(target, str) else target
    total = Estimate()
    for ops in graph.kernels():
        total = total + _kernel_estimate(graph, ops, t, spills)
    return total


# ---- one kernel -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KernelLimits:
    regs_per_lane: int
    shared_bytes: int
    capacity_units: int        # units resident on the whole device at once
    limited_by: str
    infeasible: str = ""


def kernel_limits(graph: GIRGraph, ops: tuple[GOp, ...], t: TargetSpec, regs: int | None = None) -> KernelLimits:
    """`regs`: registers per lane when known otherwise (a streamed kernel's, see _streamed)."""
    P, occ = graph.parallel, t.occupancy or _DEFAULT_OCC
    shared = _shared_bytes(graph, ops)
    regs = _registers_per_lane(graph, ops, P.lanes) if regs is None else regs
    if shared > occ.shared_per_group_max:
        return KernelLimits(regs, shared, 0, "shared", f"{shared} B shared memory per group > "
                            f"{occ.shared_per_group_max} B on {t.name}")
    limit = backend(t.backend).max_group_threads
    if limit is not None and P.units_per_group * P.lanes > limit:
        return KernelLimits(regs, shared, 0, "group", f"{P.units_per_group * P.lanes} threads per group > {limit}")
    regs_used = min(regs + occ.reg_overhead, occ.max_regs_per_lane)
    per_sm = {"units": occ.units_per_sm // P.units_per_group, "groups": occ.groups_per_sm,
              "registers": occ.regs_per_sm // max(1, regs_used * P.lanes * P.units_per_group),
              "shared": occ.shared_per_sm // shared if shared else 1 << 30}
    which = min(per_sm, key=per_sm.get)
    groups = per_sm[which]
    if groups < 1:
        return KernelLimits(regs, shared, 0, which, f"one group of {P.units_per_group} units does not fit an SM "
                            f"({which})")
    return KernelLimits(regs, shared, groups * P.units_per_group * t.groups_concurrent, which)


def _registers_per_lane(graph: GIRGraph, ops, lanes: int) -> int:
    """32-bit registers per lane the kernel's REGISTER buffers need at the peak of their
    live ranges (first to last access: the compiler reuses a dead buffer's registers), with
    the renderer's layouts (`size / width * width / lanes` slots, `size` when replicated).
    What nvcc keeps in fewer registers than the tile has slots (`_folded_words`): a product
    summed by the next gOperator, a lane-uniform load, a window built by in-lane moves."""
    width: dict[str, int] = {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, op in enumerate(ops):
        for s in op.inputs + op.outputs:
            if s.level == Level.REGISTER:
                width[s.buffer] = max(width.get(s.buffer, 0), s.width)
                first.setdefault(s.buffer, k)
                last[s.buffer] = k
    if not width:
        return 0
    words: dict[str, int] = {}
    for name, w in width.items():
        b = graph.buffer(name)
        slots = b.size if w <= 1 else -(-b.size // w) * max(1, w // lanes)
        words[name] = slots * max(1, -(-_itemsize(b.dtype) // 4))
    words, aliases = _folded_words(ops, words)
    for name, sources in aliases.items():   # a window of renamed chunks keeps the chunks live
        for b in sources:
            last[b] = max(last[b], last[name])
    live = [0] * len(ops)
    for name in width:
        for k in range(first[name], last[name] + 1):
            live[k] += words[name]
    return max(live)


def _folded_words(ops, words: dict[str, int]) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Register words nvcc does not spend on a tile, measured on the depthwise strip (a 7x7
    window over 96x56x56 ran 5.8 us on H200 with no spills where the slot count, 592 per lane,
    predicted 59 us of spilling): a product read only by the next gOperator, a sum over num,
    is an FMA chain (no tile); a tile loaded from a lane-uniform global slice (j only as
    j // vec) holds one value per vector; a tile written only by in-lane moves is its sources'
    registers renamed (returned as aliases: the sources stay live as long as it)."""
    out = dict(words)
    writers: dict[str, list[GOp]] = {}
    readers: dict[str, list[int]] = {}
    for k, op in enumerate(ops):
        for s in op.outputs:
            if s.level == Level.REGISTER:
                writers.setdefault(s.buffer, []).append(op)
        for s in op.inputs:
            if s.level == Level.REGISTER:
                readers.setdefault(s.buffer, []).append(k)
    for k, op in enumerate(ops):
        if not (op.outputs and op.outputs[0].level == Level.REGISTER):
            continue
        name = op.outputs[0].buffer
        if isinstance(op.args, Elementwise) and readers.get(name) == [k + 1] and k + 1 < len(ops) and \
                isinstance(ops[k + 1].args, Reduce) and ops[k + 1].args.over == "num" and ops[k + 1].args.fn == "sum":
            out[name] = 0
        src = op.inputs[0] if op.inputs else None
        if src is not None and src.level == Level.GLOBAL and src.vec == 1 and op.outputs[0].vec > 1 and \
                lane_uniform(src.index, op.outputs[0].vec):
            out[name] = words[name] // op.outputs[0].vec
    aliases: dict[str, set[str]] = {}
    for name, ws in writers.items():
        if all(o.args.__class__.__name__ == "Move" and o.inputs[0].level == Level.REGISTER and
               not (register_identity(o.inputs[0]) and register_identity(o.outputs[0])) for o in ws):
            out[name], aliases[name] = 0, {o.inputs[0].buffer for o in ws}
    return out, aliases


def register_identity(s: MemorySlice) -> bool:
    """A register slice in the identity layout (index i * width + j)."""
    from powerfusion.gir.expr import I, J
    return s.index == I * s.width + J or (s.num == 1 and s.index == J)


def _shared_bytes(graph: GIRGraph, ops) -> int:
    seen, total = set(), 0
    for op in ops:
        for s in op.inputs + op.outputs:
            if s.level == Level.SHARED and s.buffer not in seen:
                seen.add(s.buffer)
                b = graph.buffer(s.buffer)
                total = -(-total // 16) * 16 + b.size * _itemsize(b.dtype)
    return total


STREAMED_REGS = 64   # registers per lane of a streamed kernel (measured 32-62 on sm_90)


def _streamed(graph: GIRGraph, ops: tuple[GOp, ...], t: TargetSpec) -> list[GOp] | None:
    """The ops as the target's renderer will execute them when it streams the kernel's long
    tiles (its registered cost hook `streamed_ops`); None when the kernel is not streamed (or
    the target's backend registers no such hook)."""
    entry = backend(t.backend)
    hooks = entry.load_cost_hooks()
    if hooks is None:
        return None
    return hooks.streamed_ops(entry.load_renderer(), graph, ops,
                              _registers_per_lane(graph, ops, graph.parallel.lanes))


def _kernel_estimate(graph: GIRGraph, ops: tuple[GOp, ...], t: TargetSpec, spills: bool = True) -> Estimate:
    streamed = _streamed(graph, ops, t) if spills else None
    regs = None
    if streamed is not None:
        regs = STREAMED_REGS
    elif not spills:   # the optimistic bound: long tiles may end up streamed or split over kernels
        regs = min(_registers_per_lane(graph, ops, graph.parallel.lanes), STREAMED_REGS)
    lim = kernel_limits(graph, ops, t, regs)
    if lim.infeasible:
        return Estimate(launches=1, infeasible=lim.infeasible)
    P = graph.parallel
    est = Estimate(launches=1, limits=(f"occupancy:{lim.limited_by}",) + (("streamed",) if streamed else ()))
    read_so_far: dict[str, float] = {}
    written: set[str] = set()
    phases, pending_sync, staged = 1, False, False
    for op in (streamed if streamed is not None else ops):
        if isinstance(op.args, Sync):
            est = est + _sync_estimate(op, graph, lim, t)
            pending_sync = pending_sync or op.args.scope >= 1
            if t.memory and op.args.scope == Scope.WARP and (op.inputs or op.outputs):
                est = est + Estimate(latency_s=EXCHANGE_LATENCY * t.memory.latency_s)
            if staged and op.args.scope >= 2:
                # a group waits at the barrier for the global loads staged before it: their
                # latency is exposed once more (the stencil's tile; measured 0.4-2 us over cols)
                phases, staged = phases + 1, False
            continue
        staged = staged or _stages(op)
        if pending_sync and any(_bulk_global(s) for s in op.inputs):
            phases, pending_sync = phases + 1, False
        est = est + _op_estimate(op, graph, lim, t, read_so_far, written)
    mem = t.memory
    spill = max(0, lim.regs_per_lane + (t.occupancy or _DEFAULT_OCC).reg_overhead
                - (t.occupancy or _DEFAULT_OCC).max_regs_per_lane)
    if spill and mem and spills and streamed is None:
        # spilled registers round-trip through local memory at about DRAM speed (measured on
        # H200: a 96-float-per-lane GELU chain spilling ran 6x slower than its fused traffic)
        active = max((len(_units(op, P)) for op in ops if not isinstance(op.args, Sync)), default=0)
        spill_bytes = 2.0 * spill * 4 * P.lanes * active
        bw = t.bandwidth * mem.achievable
        est = est + Estimate(memory_s=spill_bytes / bw, limits=("register spill",))
    if mem:
        floor = mem.kernel_floor_s or 2 * mem.latency_s
        est = est + Estimate(latency_s=floor + (phases - 1) * mem.latency_s)
    return est


def _stages(op: GOp) -> bool:
    """Global data staged into shared memory: the barrier after it waits out its latency. A
    load into registers that the unit reduces before the barrier (a group reduction's row) was
    waited for by that reduction already: no extra phase (H200, GPT-2 / ViT-B/16 residual +
    LayerNorm over 4 warps a row with one barrier per statistic, 2.92-2.94 us where the phase
    made the model predict 4.2-4.3 us and pick one warp a row at 3.2-3.7 us)."""
    return any(s.level == Level.GLOBAL for s in op.inputs) and any(s.level == Level.SHARED for s in op.outputs)


def _bulk_global(s: MemorySlice) -> bool:
    """A global read that starts a new dependent phase after a sync: more than one element per
    unit. A scalar every unit reads (a mean's 1/N, an epsilon) is a cached constant, not a DRAM
    round trip (same measurement as _stages)."""
    return s.level == Level.GLOBAL and s.count > 1


def _sync_estimate(op: GOp, graph: GIRGraph, lim: KernelLimits, t: TargetSpec) -> Estimate:
    scope = op.args.scope.label
    P = graph.parallel
    if scope == "block":
        waves = math.ceil(P.units / max(1, lim.capacity_units))
    else:
        waves = math.ceil(P.units / max(1, lim.capacity_units)) if scope == "warp" else 0
    return Estimate(syncs=((scope, 1),), sync_s=t.sync_s.get(scope, 0.0) * waves)


def _op_estimate(op: GOp, graph: GIRGraph, lim: KernelLimits, t: TargetSpec,
                 read_so_far: dict[str, float], written: set[str]) -> Estimate:
    P = graph.parallel
    units = _units(op, P)
    n_active = len(units)
    if n_active == 0:
        return Estimate()
    waves = math.ceil(n_active / max(1, lim.capacity_units))
    concurrent = n_active / waves                       # units in flight, averaged over waves
    sms_used = min(t.groups_concurrent, math.ceil(concurrent / P.units_per_group))
    by_level: dict[str, float] = {}
    dram = cached = 0.0
    inflight = 0.0
    scatter_s = 0.0
    shared_s = 0.0
    index_ops = 0.0
    lane_vec = _lane_vec(op)
    for s, is_write in [(s, False) for s in op.inputs] + [(s, True) for s in op.outputs]:
        nbytes = _elements(s, units) * _itemsize(s.dtype)
        if s.level == Level.GLOBAL and not is_write and s.vec == 1 and lane_vec > 1 and \
                lane_uniform(s.index, lane_vec):
            nbytes /= lane_vec   # one address per lane's vector, loaded once (see _lsu_seconds)
        by_level[s.level.label] = by_level.get(s.level.label, 0.0) + nbytes
        if s.level == Level.GLOBAL:
            amp = _sector_amplification(s, units, P, t.memory)
            footprint = graph.buffer(s.buffer).size * _itemsize(s.dtype)
            if is_write:
                d, c = nbytes, 0.0
                written.add(s.buffer)
            elif s.buffer in written:
                d, c = 0.0, nbytes
            else:
                before = read_so_far.get(s.buffer, 0.0)
                fresh = max(0.0, min(nbytes, footprint - before))
                fits = t.memory is None or footprint <= t.memory.cache_bytes
                d, c = (fresh, nbytes - fresh) if fits else (nbytes, 0.0)
                read_so_far[s.buffer] = before + nbytes
            dram += d
            cached += c
            if amp > 1.0:  # extra sectors of an uncoalesced access keep the load/store units busy
                scatter_s += nbytes * (amp - 1.0) / _scatter_rate(t, is_write, sms_used)
            vec = _rendered_vec(op, s, P, t)
            # global addresses only: the flat stencil's per-element // and % into its shared
            # tile measured fastest all the same (gir-dwconv.md), so shared ones are not charged
            index_ops += _elements(s, units) * slice_index_ops(s, vec, lane_vec)
            lanes_used = min(P.lanes, max(1, -(-s.width // max(1, vec))))
            # loads into registers are unrolled over segments and lane chunks; stores need no wait
            ilp = ILP_CAP if is_write else _load_ilp(op, s, P, t)
            inflight = max(inflight, lanes_used * vec * _itemsize(s.dtype) * ilp)
        elif s.level == Level.SHARED:
            rate = t.levels["shared"].bandwidth * sms_used / t.groups_concurrent
            shared_s += nbytes * _bank_conflicts(s, units, P) / rate
    memory_s = shared_s + scatter_s
    limits: list[str] = ["uncoalesced"] if scatter_s else []
    if dram or cached:
        bw = _global_bandwidth(t, concurrent, sms_used, inflight)
        memory_s += max(dram / bw, (dram + cached) / _cache_bandwidth(t, sms_used))
        if bw < t.bandwidth * (t.memory.achievable if t.memory else 1.0) * 0.999:
            limits.append("parallelism")
    lsu_s = _lsu_seconds(op, units, P, t, sms_used)
    if lsu_s > memory_s:
        memory_s = lsu_s
        limits.append("load/store issue")
    flops = _flops(op, units, P)
    compute_s = 0.0
    warps_per_sm = concurrent / max(1, sms_used)
    issue = sms_used / t.groups_concurrent * min(1.0, warps_per_sm / ISSUE_WARPS)
    if flops:
        compute_s = flops / max(t.vector_flops / 2 * issue, 1.0)
    if index_ops:   # integer address and mask arithmetic (index_cost.py), at the INT32 issue rate
        compute_s += index_ops / max(t.vector_flops / 2 * INT_RATE * issue, 1.0)
        limits.append("index arithmetic")
    return Estimate(tuple(sorted(by_level.items())), flops, memory_s=memory_s, compute_s=compute_s,
                    limits=tuple(limits))


def _lsu_seconds(op: GOp, units: np.ndarray, P: Parallel, t: TargetSpec, sms_used: int) -> float:
    """The SMs' load/store pipe: every warp-wide access of a GLOBAL or SHARED slice is one
    instruction however few of its lanes are live, and takes a wavefront per 128-byte line
    (global: the sectors it touches over the coalesced minimum; shared: its bank-conflict
    degree); an SM retires one wavefront per clock, the rate the calibrated shared bandwidth
    measures (128 B per clock per SM). Measured on H200 (benchmarks/results/gir-dwconv.md): a
    7x7 depthwise conv over 7x7 planes, one unit per 7-wide row, ran 4.2 us where the bytes
    alone predicted 2.6 (25 of 32 lanes idle in each of 98 accesses per output row); the
    stencil over the flattened plane, a quarter of the instructions, ran 2.9."""
    if t.lanes < 2 or not len(units):
        return 0.0
    shared = t.levels.get("shared")
    if shared is None or not shared.bandwidth:
        return 0.0
    rate = shared.bandwidth / 128.0 * sms_used / t.groups_concurrent
    waves = 0.0
    lane_vec = _lane_vec(op)
    for s in op.inputs + op.outputs:
        if s.level == Level.REGISTER:
            continue
        vec = _access_vec(s, units)
        if vec == 1 and lane_vec > 1 and lane_uniform(s.index, lane_vec):
            vec = lane_vec   # one address per lane's vector: nvcc loads it once
        per_unit = s.num * max(1, -(-s.width // (P.lanes * vec)))
        degree = _bank_conflicts(s, units, P) if s.level == Level.SHARED else \
            _sector_amplification(s, units, P, t.memory)
        waves += per_unit * len(units) * degree
    return waves / rate


def _lane_vec(op: GOp) -> int:
    """The vector width of the register tiles an op reads or writes (a lane's run of elements)."""
    return max((s.vec for s in op.inputs + op.outputs if s.level == Level.REGISTER), default=1)


def _access_vec(s: MemorySlice, units: np.ndarray) -> int:
    """The vector width a lane's access gets: the slice's, where the index is contiguous in j
    and each segment starts aligned (sampled), else 1 (the renderer then goes element-wise)."""
    if s.vec == 1 or loads(s.index) or affine_coefficient(s.index, "j") != 1:
        return 1
    return s.vec if _aligned_cached(s.index, s.num, s.vec, tuple(_sample_units(units))) else 1


@lru_cache(maxsize=65536)
def _aligned_cached(index, num, vec, sample_units) -> bool:
    u = np.asarray(sample_units, dtype=np.int64)[:, None]
    i = np.arange(min(num, 8), dtype=np.int64)[None, :]
    return not np.any(np.asarray(evaluate(index, {"u": u, "i": i, "j": 0})) % vec)


def _global_bandwidth(t: TargetSpec, concurrent: float, sms_used: int, inflight: float) -> float:
    """DRAM bandwidth of `concurrent` units on `sms_used` SMs, each keeping `inflight` bytes of
    loads in flight. The per-SM bandwidth vs resident warps curve was measured with float4
    warp accesses (512 B) at `curve_ilp` loads in flight; a unit with more or less in flight
    counts as proportionally more or fewer warps. Capped at the achievable bandwidth and at a
    few times the SMs' even share of it."""
    mem = t.memory
    peak = t.bandwidth * (mem.achievable if mem else 1.0)
    if mem is None:
        return peak
    warps = concurrent / max(1, sms_used) * inflight / (512.0 * mem.curve_ilp)
    return max(1.0, min(peak, sms_used * _per_sm_bandwidth(t, warps),
                        PER_SM_SHARE * peak * sms_used / t.groups_concurrent))


def _per_sm_bandwidth(t: TargetSpec, warps: float) -> float:
    """Interpolated in log2(warps); below the first point linear in warps, beyond the last flat.
    Without a measured curve: Little's law at the datasheet latency."""
    mem = t.memory
    curve = mem.bw_curve or tuple((w, min(t.bandwidth * mem.achievable / t.groups_concurrent,
                                         w * 512.0 * mem.curve_ilp / mem.latency_s))
                                  for w in (1, 2, 4, 8, 16, 32, 64))
    xs, ys = [w for w, _ in curve], [b for _, b in curve]
    if warps <= xs[0]:
        return ys[0] * warps / xs[0]
    return float(np.interp(math.log2(warps), np.log2(xs), ys))


def _global_copy(op: GOp, P: Parallel, t: TargetSpec) -> bool | None:
    """Does the target's renderer emit this global -> global move as unrolled vector copies
    (its cost hook `vector_copy`)? None when it is no such move or the backend does not say."""
    if len(op.inputs) != 1 or len(op.outputs) != 1 or type(op.args).__name__ != "Move":
        return None
    src, dst = op.inputs[0], op.outputs[0]
    if not src.level == dst.level == Level.GLOBAL:
        return None
    hooks = backend(t.backend).load_cost_hooks()
    if hooks is None or not hasattr(hooks, "vector_copy"):
        return None
    return bool(hooks.vector_copy(src, dst, P.lanes))


def _rendered_vec(op: GOp, s: MemorySlice, P: Parallel, t: TargetSpec) -> int:
    """The access width the renderer gives a global slice: a global -> global move that is
    not a vector copy (an index not contiguous and aligned in j: a composed shuffle's planes
    behind a div/mod chain) goes element by element, whatever the slice's vec says."""
    if s.vec > 1 and _global_copy(op, P, t) is False:
        return 1
    return s.vec


def _load_ilp(op: GOp, s: MemorySlice, P: Parallel, t: TargetSpec) -> int:
    """Independent loads per lane: the renderer unrolls a register destination's segments and
    lane chunks, and a global vector copy's; the generic element loop (into shared memory)
    gets what nvcc's default unrolling of a simple loop gives."""
    dst = op.outputs[0] if op.outputs else None
    if dst is not None and _global_copy(op, P, t):
        return int(min(ILP_CAP, max(1, s.num * max(1, s.width // (P.lanes * max(1, s.vec))))))
    if dst is None or dst.level != Level.REGISTER:
        return LOOP_ILP
    return int(min(ILP_CAP, max(1, s.num * max(1, s.width // (P.lanes * max(1, s.vec))))))


def _scatter_rate(t: TargetSpec, write: bool, sms_used: int) -> float:
    mem = t.memory
    rate = (mem.scatter_write or 0.7 * t.bandwidth) if write else (mem.scatter_read or 1.5 * t.bandwidth)
    return rate * sms_used / t.groups_concurrent


def _cache_bandwidth(t: TargetSpec, sms_used: int) -> float:
    mem = t.memory
    if mem is None:
        return t.bandwidth
    return mem.cache_bandwidth * min(1.0, PER_SM_SHARE * sms_used / t.groups_concurrent)


def _flops(op: GOp, units: np.ndarray, P: Parallel) -> float:
    a = op.args
    if isinstance(a, Elementwise):
        from powerfusion.scalar import SCALAR_FNS
        fn = SCALAR_FNS.get(a.fn)
        return float(op.outputs[0].count * len(units) * (fn.flops if fn else 1))
    if isinstance(a, Reduce):
        s = op.inputs[0]
        shuffles = 2 * int(math.log2(max(P.lanes, 1))) * P.lanes * s.num if a.over == "width" and s.width > 1 else 0
        per = SUMEXP_FLOPS if a.fn == "sumexp" else 1
        return float((s.count * per + shuffles) * len(units))
    return 0.0


# ---- sampled access patterns --------------------------------------------------------------

def _sector_amplification(s: MemorySlice, units: np.ndarray, P: Parallel, mem: MemorySystem | None) -> float:
    if mem is None or loads(s.index):
        return 1.0
    return _amp_cached(s.index, s.num, s.width, s.vec, _itemsize(s.dtype), mem.sector_bytes,
                       tuple(_sample_units(units)), P.lanes)


def _sample_units(units: np.ndarray) -> np.ndarray:
    return units[np.unique(np.linspace(0, len(units) - 1, min(4, len(units))).astype(np.int64))]


@lru_cache(maxsize=65536)
def _amp_cached(index, num, width, vec, size, sector, sample_units, lanes) -> float:
    u = np.asarray(sample_units, dtype=np.int64)[:, None, None]
    i = np.arange(min(num, 2), dtype=np.int64)[None, :, None]
    j = np.arange(min(width, lanes * max(1, vec)), dtype=np.int64)[None, None, :]
    addr = np.broadcast_to(evaluate(index, {"u": u, "i": i, "j": j}), (u.shape[0], i.shape[1], j.shape[2]))
    byte = addr.reshape(-1, j.shape[2]) * size
    n = j.shape[2]
    ideal = max(1, -(-n * size // sector))
    touched = [len(np.unique(row // sector)) for row in byte]
    return max(1.0, float(np.mean(touched)) / ideal)


def _bank_conflicts(s: MemorySlice, units: np.ndarray, P: Parallel) -> float:
    if loads(s.index):
        return 1.0
    return _banks_cached(s.index, s.num, s.width, s.vec, _itemsize(s.dtype), tuple(_sample_units(units)), P.lanes)


@lru_cache(maxsize=65536)
def _banks_cached(index, num, width, vec, size, sample_units, lanes) -> float:
    u = np.asarray(sample_units, dtype=np.int64)[:, None, None]
    i = np.arange(min(num, 2), dtype=np.int64)[None, :, None]
    j = np.arange(min(width, lanes * max(1, vec)), dtype=np.int64)[None, None, :]
    addr = np.broadcast_to(evaluate(index, {"u": u, "i": i, "j": j}), (u.shape[0], i.shape[1], j.shape[2]))
    words = (addr.reshape(-1, j.shape[2]) * size) // 4
    out = []
    for row in words:
        w = np.unique(row)
        per_bank = np.bincount(w % 32, minlength=32)
        out.append(per_bank.max() / max(1, -(-len(w) // 32)))
    return max(1.0, float(np.mean(out)))
