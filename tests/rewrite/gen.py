"""A generator of merged GIR graphs (templates + DEVICE syncs between them) with a numpy reference.

Each basic op is one template over a [R, C] float32 tensor: load its inputs from global
into registers under a *tiling*, compute, store. Tilings: "rows" (unit u = row u),
"cols" (unit u = column u, one element per segment), "chunks" (flat pieces of W elements,
the tail masked). Consecutive templates meet at a global tensor with a DEVICE sync between
the store and the load, as the merge step produces them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from powerfusion.gir.expr import I, J, U
from powerfusion.gir.ir import (Broadcast, Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel,
                                Reduce, Scope, Sync)

UNARY = ("relu", "exp", "neg", "tanh", "abs", "sigmoid")


@dataclass(frozen=True)
class Tiling:
    kind: str    # rows | cols | chunks
    R: int
    C: int
    W: int = 4

    @property
    def units(self) -> int:
        return {"rows": self.R, "cols": self.C, "chunks": -(-self.R * self.C // self.W)}[self.kind]

    def glob(self, name: str, vec: int = 1) -> MemorySlice:
        R, C, W = self.R, self.C, self.W
        if self.kind == "rows":
            return MemorySlice(name, Level.GLOBAL, U * C + J, 1, C, "float32", vec)
        if self.kind == "cols":
            return MemorySlice(name, Level.GLOBAL, I * C + U, R, 1, "float32", vec)
        return MemorySlice(name, Level.GLOBAL, U * W + J, 1, W, "float32", vec, valid=(U * W + J).lt(R * C))

    def reg(self, name: str, vec: int = 1) -> MemorySlice:
        s = self.glob(name, vec)
        return MemorySlice(name, Level.REGISTER, I * s.width + J, s.num, s.width, "float32", vec)

    @property
    def count(self) -> int:
        return self.glob("x").count


@dataclass
class Builder:
    R: int
    C: int
    units: int
    ops: list = field(default_factory=list)
    bufs: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    values: dict = field(default_factory=dict)

    def buf(self, name: str, level: Level, size: int) -> str:
        self.bufs[name] = Buffer(name, level, size, "float32")
        return name

    def guard(self, t: Tiling):
        return None if t.units == self.units else U.lt(t.units)

    def op(self, args, ins, outs, t: Tiling, origin: str):
        self.ops.append(GOp(args, tuple(ins), tuple(outs), self.guard(t), origin))


def _template(b: Builder, k: int, kind: str, src: str, t_in: Tiling, t_out: Tiling, other: str | None, fn: str):
    """Load `src` (and `other`), compute, store to a new global tensor; returns its name."""
    out = b.buf(f"T{k}", Level.GLOBAL, b.R * b.C)
    x = b.buf(f"x{k}", Level.REGISTER, t_in.count)
    b.op(Move(), [t_in.glob(src)], [t_in.reg(x)], t_in, f"n{k}")
    if kind == "unary":
        y = b.buf(f"y{k}", Level.REGISTER, t_in.count)
        b.op(Elementwise(fn), [t_in.reg(x)], [t_in.reg(y)], t_in, f"n{k}")
    elif kind == "add":
        o = b.buf(f"o{k}", Level.REGISTER, t_in.count)
        b.op(Move(), [t_in.glob(other)], [t_in.reg(o)], t_in, f"n{k}")
        y = b.buf(f"y{k}", Level.REGISTER, t_in.count)
        b.op(Elementwise("add"), [t_in.reg(x), t_in.reg(o)], [t_in.reg(y)], t_in, f"n{k}")
    elif kind == "center":      # y = x - max(x) over the row (rows tiling only)
        m = b.buf(f"m{k}", Level.REGISTER, 1)
        mb = b.buf(f"mb{k}", Level.REGISTER, t_in.count)
        y = b.buf(f"y{k}", Level.REGISTER, t_in.count)
        ms = MemorySlice(m, Level.REGISTER, I + J, 1, 1, "float32")
        b.op(Reduce("max", "width"), [t_in.reg(x)], [ms], t_in, f"n{k}")
        b.op(Broadcast("width"), [ms], [t_in.reg(mb)], t_in, f"n{k}")
        b.op(Elementwise("sub"), [t_in.reg(x), t_in.reg(mb)], [t_in.reg(y)], t_in, f"n{k}")
    else:                       # copy (a move-only op, e.g. a reshape materialised)
        y = x
    b.op(Move(), [t_out.reg(y)], [t_out.glob(out)], t_out, f"n{k}")
    return out


def reference(kind: str, x: np.ndarray, other: np.ndarray | None, fn: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        if kind == "unary":
            from powerfusion.scalar import scalar_fn
            return scalar_fn(fn).numpy(x).astype(np.float32)
        if kind == "add":
            return (x + other).astype(np.float32)
        if kind == "center":
            return (x - x.max(axis=1, keepdims=True)).astype(np.float32)
    return x


@st.composite
def merged_graphs(draw, max_ops: int = 4):
    """(GIRGraph, feeds, expected outputs)."""
    R, C = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    W = draw(st.sampled_from([2, 4, 8]))
    n_ops = draw(st.integers(1, max_ops))
    plan = []
    for _ in range(n_ops):
        kind = draw(st.sampled_from(["unary", "unary", "add", "center", "copy"]))
        t = Tiling("rows" if kind == "center" else draw(st.sampled_from(["rows", "cols", "chunks"])), R, C, W)
        plan.append((kind, t, t, draw(st.sampled_from(UNARY)), draw(st.booleans()) and draw(st.booleans())))
    units = max(max(p[1].units, p[2].units) for p in plan)
    b = Builder(R, C, units)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    cur = b.buf("X", Level.GLOBAL, R * C)
    b.inputs.append(cur)
    b.values[cur] = rng.standard_normal((R, C)).astype(np.float32)
    expected = {}
    prev_store = None
    for k, (kind, t_in, t_out, fn, also_output) in enumerate(plan):
        other = None
        if kind == "add":
            other = b.buf(f"A{k}", Level.GLOBAL, R * C)
            b.inputs.append(other)
            b.values[other] = rng.standard_normal((R, C)).astype(np.float32)
        if prev_store is not None:
            b.ops.append(GOp(Sync(Scope.DEVICE), (prev_store,), (t_in.glob(cur),), origin=f"n{k}"))
        out = _template(b, k, kind, cur, t_in, t_out, other, fn)
        b.values[out] = reference(kind, b.values[cur], b.values.get(other), fn)
        prev_store = b.ops[-1].outputs[0]
        cur = out
        if also_output or k == n_ops - 1:
            b.outputs.append(out)
            expected[out] = b.values[out]
    g = GIRGraph("gen", Parallel(units, 2, 4), tuple(b.bufs.values()), tuple(b.ops), tuple(b.inputs), tuple(b.outputs))
    feeds = {n: b.values[n] for n in b.inputs}
    return g, feeds, expected
