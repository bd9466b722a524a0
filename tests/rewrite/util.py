"""Before / transform / expected checks for rewrite rules (TVM style), compared structurally.

Graphs are compared gOperator by gOperator: kind and arguments, guard, and for every slice
its buffer, level, shape, type, vector width and fill; index and valid expressions are
compared as functions (evaluated over every unit, segment and element), so an expected
graph need not spell an index the way the rule's algebra happened to build it (indices are
compared where the slice's valid mask holds: masked-off elements are never touched).
"""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import I, J, evaluate
from powerfusion.gir.interpreter import run_gir
from powerfusion.gir.ir import Buffer, GIRGraph, GOp, Level, MemorySlice, Parallel

F32 = "float32"


def glob(name, index, num, width, valid=None, vec=1, dtype=F32) -> MemorySlice:
    return MemorySlice(name, Level.GLOBAL, index, num, width, dtype, vec, valid)


def reg(name, num, width, vec=1, dtype=F32, valid=None, fill=0.0) -> MemorySlice:
    return MemorySlice(name, Level.REGISTER, I * width + J, num, width, dtype, vec, valid, fill)


def graph(ops, buffers, inputs, outputs, units=4, upg=2, lanes=4, name="t") -> GIRGraph:
    return GIRGraph(name, Parallel(units, upg, lanes), tuple(buffers), tuple(ops), tuple(inputs), tuple(outputs))


def gbuf(name, size, level=Level.GLOBAL, dtype=F32) -> Buffer:
    return Buffer(name, level, size, dtype)


def show(g: GIRGraph | None) -> str:
    if g is None:
        return "  (rule did not fire)"
    lines = [f"  {k}: {op.describe()}  idx=[{', '.join(repr(s.index) for s in op.inputs + op.outputs)}]"
             + (f" guard={op.guard!r}" if op.guard is not None else "") for k, op in enumerate(g.ops)]
    lines.append("  buffers: " + ", ".join(f"{b.name}@{b.level.label}[{b.size}]" for b in g.buffers))
    return "\n".join(lines)


def _values(e, units, num, width):
    env = {"u": np.asarray(units)[:, None, None], "i": np.arange(num)[None, :, None], "j": np.arange(width)[None, None, :]}
    shape = (len(units), num, width)
    return np.broadcast_to(evaluate(e, env), shape) if e is not None else np.ones(shape, bool)


def slices_equal(a: MemorySlice, b: MemorySlice, units) -> bool:
    """Same slice up to how its expressions are spelled: the masks agree everywhere and the
    indices wherever the mask holds (a masked-off element is never touched)."""
    same = (a.buffer, a.level, a.num, a.width, a.dtype, a.vec, a.fill) == (b.buffer, b.level, b.num, b.width, b.dtype, b.vec, b.fill)
    if not same:
        return False
    va, vb = _values(a.valid, units, a.num, a.width), _values(b.valid, units, b.num, b.width)
    if not np.array_equal(va.astype(bool), vb.astype(bool)):
        return False
    m = va.astype(bool)
    return bool(np.array_equal(_values(a.index, units, a.num, a.width)[m], _values(b.index, units, b.num, b.width)[m]))


def ops_equal(a: GOp, b: GOp, parallel: Parallel) -> bool:
    if type(a.args) is not type(b.args) or a.args != b.args or a.guard != b.guard:
        return False
    if len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs):
        return False
    units = a.active_units(parallel.units)
    return all(slices_equal(x, y, units) for x, y in zip(a.inputs + a.outputs, b.inputs + b.outputs))


def graphs_equal(a: GIRGraph | None, b: GIRGraph | None) -> bool:
    if a is None or b is None:
        return a is b
    return (len(a.ops) == len(b.ops) and all(ops_equal(x, y, a.parallel) for x, y in zip(a.ops, b.ops))
            and set(a.buffers) == set(b.buffers) and a.inputs == b.inputs and a.outputs == b.outputs)


def random_feeds(g: GIRGraph, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(g.buffer(n).size).astype(g.buffer(n).dtype) for n in g.inputs}


def same_outputs(a: GIRGraph, b: GIRGraph, feeds) -> bool:
    oa, ob = run_gir(a, feeds), run_gir(b, feeds)
    return all(np.array_equal(oa[n], ob[n], equal_nan=True) for n in a.outputs)


def check_rule(rule, before: GIRGraph, at: int, expected: GIRGraph | None):
    """Apply `rule` at `at`; the result must equal `expected` (None: the rule must not fire) and,
    when it fires, compute the same outputs as `before`."""
    rw = rule(before, at)
    after = rw.apply(before) if rw is not None else None
    msg = (f"\nbefore:\n{show(before)}\ntransform: {rule.__name__} at {at}\n"
           f"after:\n{show(after)}\nexpected:\n{show(expected)}")
    assert graphs_equal(after, expected), msg
    if after is not None:
        feeds = random_feeds(before)
        assert same_outputs(before, after, feeds), "outputs differ" + msg
    return after
