"""Static checks of a GIR graph: `verify(graph)` raises GIRVerifyError naming the first problem.

Structure: buffers exist at the slice's level and dtype; moves keep element counts;
elementwise operands share num x width; reduce/broadcast shapes agree with `over`;
compute only on REGISTER slices; syncs pair written and read slices of the same buffers;
BLOCK syncs are group-uniform and DEVICE syncs unguarded.

Data flow, by walking the schedule and evaluating every slice with numpy:
* every slice stays inside its buffer for every active unit (index expressions that load
  -- gather -- are bounded by interval arithmetic, the loaded value taking any value);
* every element read was written earlier or belongs to a graph input / constant;
* when an element written by (unit, lane) is read by another (unit, lane) there is a Sync
  of at least the needed scope in between (powerfusion.gir.scope: WARP for the same unit,
  BLOCK for the same group, DEVICE otherwise). Register data crossing lanes is exempt
  where the reader is a reduce or broadcast (they exchange lanes themselves) or the
  writer is a reduce over width (its result is replicated across the lanes);
* no gOperator writes one element from two units, and no unit overwrites a SHARED or
  GLOBAL element another unit read since its last write without a sync ordering the two;
* every element of every graph output is written.

Huge graphs: when evaluating all units (their largest slice, or their register and shared
state) would exceed `cap` elements, only whole groups are checked -- the first, the last
and a seeded random subset. Register and shared checks stay exact for those groups; for
GLOBAL buffers an element written by an unchecked unit is unknown, so unwritten-read and
output-coverage checks are skipped.
"""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import Expr, loads, variables
from powerfusion.gir.ir import Broadcast, Elementwise, GIRGraph, GOp, Level, Move, Reduce, Scope, Sync
from powerfusion.gir.verifier_flow import GIRVerifyError, _Flow, interval  # noqa: F401 -- named here for callers
from powerfusion.scalar import SCALAR_FNS

CAP = 1 << 21  # elements of evaluation and per-element state the walk may hold
_REDUCE_FNS = ("sum", "max", "min", "prod", "sumexp")


def verify(graph: GIRGraph, cap: int = CAP, seed: int = 0) -> None:
    _check_structure(graph)
    _Flow(graph, cap, seed).run()


# ---- structure -------------------------------------------------------------------------

def _fail(graph: GIRGraph, k: int | None, op: GOp | None, msg: str):
    where = f" at op {k} ({op.describe()}, from '{op.origin}')" if op is not None else ""
    raise GIRVerifyError(f"GIR graph '{graph.name}'{where}: {msg}")


def _check_structure(g: GIRGraph) -> None:
    bufs = {}
    for b in g.buffers:
        if b.name in bufs:
            _fail(g, None, None, f"buffer '{b.name}' declared twice")
        if b.size <= 0:
            _fail(g, None, None, f"buffer '{b.name}' has size {b.size}")
        bufs[b.name] = b
    for name in g.inputs + g.outputs + tuple(n for n, _ in g.constants):
        if name not in bufs or bufs[name].level != Level.GLOBAL:
            _fail(g, None, None, f"interface buffer '{name}' is not a declared GLOBAL buffer")
    P = g.parallel
    if P.units < 1 or P.units_per_group < 1 or P.lanes < 1:
        _fail(g, None, None, f"bad parallel structure {P}")
    for k, op in enumerate(g.ops):
        for s in op.inputs + op.outputs:
            b = bufs.get(s.buffer)
            if b is None:
                _fail(g, k, op, f"slice of undeclared buffer '{s.buffer}'")
            if b.level != s.level:
                _fail(g, k, op, f"slice of '{s.buffer}' at {s.level.label}, buffer is {b.level.label}")
            if b.dtype != s.dtype:
                _fail(g, k, op, f"slice of '{s.buffer}' typed {s.dtype}, buffer holds {b.dtype}")
            if s.num < 1 or s.width < 1 or s.vec < 1 or (s.width % s.vec and s.width != 1):
                _fail(g, k, op, f"slice {s.describe()} has bad shape (num {s.num}, width {s.width}, vec {s.vec})")
            for e in (s.index, s.valid):
                if e is not None and not variables(e) <= {"u", "i", "j"}:
                    _fail(g, k, op, f"slice {s.describe()} uses variables {sorted(variables(e))}")
                for lb in (loads(e) if e is not None else ()):
                    if lb not in bufs or bufs[lb].level != Level.GLOBAL:
                        _fail(g, k, op, f"index loads from '{lb}', not a GLOBAL buffer")
        if op.guard is not None and not variables(op.guard) <= {"u"}:
            _fail(g, k, op, "a guard may depend on the unit only")
        _check_op_shape(g, k, op)


def _check_op_shape(g: GIRGraph, k: int, op: GOp) -> None:
    a = op.args
    ins, outs = op.inputs, op.outputs
    if isinstance(a, Sync):
        wrote = {s.buffer for s in ins}
        for s in outs:
            if s.buffer not in wrote:
                _fail(g, k, op, f"sync reads '{s.buffer}' after it without a slice as written before it")
        if a.scope == Scope.DEVICE and op.guard is not None:
            _fail(g, k, op, "a DEVICE sync (kernel boundary) cannot be guarded")
        if a.scope == Scope.BLOCK and op.guard is not None and not _group_uniform(op.guard, g.parallel):
            _fail(g, k, op, "a BLOCK sync must be reached by all units of a group (guard not group-uniform)")
        return
    if len(outs) != 1:
        _fail(g, k, op, f"{op.kind} has {len(outs)} outputs, expected 1")
    out = outs[0]
    if isinstance(a, Move):
        if len(ins) != 1:
            _fail(g, k, op, f"move has {len(ins)} inputs")
        if ins[0].count != out.count:
            _fail(g, k, op, f"move changes the element count: {ins[0].count} -> {out.count}")
        return
    for s in ins + outs:
        if s.level != Level.REGISTER:
            _fail(g, k, op, f"{op.kind} on a {s.level.label} slice ({s.describe()}); compute works on registers")
    if isinstance(a, Elementwise):
        fn = SCALAR_FNS.get(a.fn)
        if fn is None:
            _fail(g, k, op, f"unknown scalar function '{a.fn}'")
        if len(ins) != fn.arity:
            _fail(g, k, op, f"'{a.fn}' takes {fn.arity} operands, got {len(ins)}")
        for s in ins:
            if (s.num, s.width) != (out.num, out.width):
                _fail(g, k, op, f"operand {s.describe()} is {s.num}x{s.width}, output {out.num}x{out.width}")
    elif isinstance(a, Reduce):
        if a.fn not in _REDUCE_FNS or a.over not in ("num", "width") or len(ins) != 1:
            _fail(g, k, op, f"bad reduce {a}")
        if a.fn == "sumexp" and (a.over != "num" or g.buffer(out.buffer).dtype not in ("float32", "float64")):
            _fail(g, k, op, "reduce(sumexp) is defined over num into a float32 or float64 tile only")
        s = ins[0]
        want = (s.num, 1) if a.over == "width" else (1, s.width)
        if (out.num, out.width) != want:
            _fail(g, k, op, f"reduce over {a.over} of {s.num}x{s.width} gives {want[0]}x{want[1]}, "
                            f"output is {out.num}x{out.width}")
    elif isinstance(a, Broadcast):
        s = ins[0] if len(ins) == 1 else _fail(g, k, op, "broadcast takes one input")
        ok = (s.width == 1 and s.num == out.num) if a.over == "width" else (s.num == 1 and s.width == out.width)
        if a.over not in ("num", "width") or not ok:
            _fail(g, k, op, f"broadcast over {a.over} cannot take {s.num}x{s.width} to {out.num}x{out.width}")


def _group_uniform(guard: Expr, P) -> bool:
    u = np.arange(P.units, dtype=np.int64)
    from powerfusion.gir.expr import evaluate
    v = np.broadcast_to(evaluate(guard, {"u": u}), u.shape).astype(bool)
    pad = (-len(v)) % P.units_per_group
    v = np.concatenate([v, np.repeat(v[-1:], pad)]).reshape(-1, P.units_per_group)
    return bool(np.all(v == v[:, :1]))
