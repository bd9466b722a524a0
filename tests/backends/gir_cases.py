"""Hand-built GIR graphs that exercise every gOperator kind and layout the C renderer
implements, each with a numpy reference. Shared by the CPU compile checks and the GPU tests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from powerfusion.gir.expr import I, J, U
from powerfusion.gir.ir import (Broadcast, Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move,
                                Parallel, Reduce, Scope, Sync)


@dataclass
class Case:
    graph: GIRGraph
    feeds: dict
    reference: Callable[[dict], dict]


def _numbered(ops):
    from dataclasses import replace
    return tuple(replace(op, uid=k) for k, op in enumerate(ops))


def layernorm_rows(rows: int, n: int, dtype: str = "float32", lanes: int = 32, vec: int = 4, eps: float = 1e-5) -> Case:
    """One unit per row: load, mean by a width-reduce (warp shuffles), centre, variance, scale, store."""
    width = lanes * vec
    num = -(-n // width)
    G, R = Level.GLOBAL, Level.REGISTER
    valid = (I * width + J).lt(n)
    gx = MemorySlice(f"x", G, U * n + I * width + J, num, width, dtype, vec, valid)
    gy = MemorySlice(f"y", G, U * n + I * width + J, num, width, dtype, vec, valid)
    reg = lambda b, v=None: MemorySlice(b, R, I * width + J, num, width, "float32", vec, v)
    col = lambda b: MemorySlice(b, R, I, num, 1, "float32")
    one = lambda b: MemorySlice(b, R, I, 1, 1, "float32")
    row = lambda b: MemorySlice(b, R, I, num, 1, "float32")
    ops = [
        GOp(Move(), (gx,), (reg("xr"),)),
        GOp(Reduce("sum", "width"), (reg("xr", valid),), (col("ps"),)),
        GOp(Reduce("sum", "num"), (col("ps"),), (one("s"),)),
        GOp(Elementwise("mul"), (one("s"), one("inv_n")), (one("mean"),)),
        GOp(Broadcast("num"), (one("mean"),), (row("mean_r"),)),
        GOp(Broadcast("width"), (row("mean_r"),), (reg("mean_b"),)),
        GOp(Elementwise("sub"), (reg("xr"), reg("mean_b")), (reg("d"),)),
        GOp(Elementwise("mul"), (reg("d"), reg("d")), (reg("d2"),)),
        GOp(Reduce("sum", "width"), (reg("d2", valid),), (col("pv"),)),
        GOp(Reduce("sum", "num"), (col("pv"),), (one("v"),)),
        GOp(Elementwise("mul"), (one("v"), one("inv_n")), (one("var"),)),
        GOp(Elementwise("add"), (one("var"), one("eps")), (one("ve"),)),
        GOp(Elementwise("rsqrt"), (one("ve"),), (one("rstd"),)),
        GOp(Broadcast("num"), (one("rstd"),), (row("rstd_r"),)),
        GOp(Broadcast("width"), (row("rstd_r"),), (reg("rstd_b"),)),
        GOp(Elementwise("mul"), (reg("d"), reg("rstd_b")), (reg("yv"),)),
        GOp(Move(), (reg("yv"),), (gy,)),
    ]
    consts = (("inv_n_g", np.array([1.0 / n], np.float32)), ("eps_g", np.array([eps], np.float32)))
    ops = [GOp(Move(), (MemorySlice("inv_n_g", G, I, 1, 1, "float32"),), (one("inv_n"),)),
           GOp(Move(), (MemorySlice("eps_g", G, I, 1, 1, "float32"),), (one("eps"),))] + ops
    bufs = [Buffer("x", G, rows * n, dtype), Buffer("y", G, rows * n, dtype),
            Buffer("inv_n_g", G, 1, "float32"), Buffer("eps_g", G, 1, "float32")]
    for b in ("xr", "mean_b", "d", "d2", "rstd_b", "yv"):
        bufs.append(Buffer(b, R, num * width, "float32"))
    for b in ("ps", "pv", "mean_r", "rstd_r"):
        bufs.append(Buffer(b, R, num, "float32"))
    for b in ("s", "mean", "v", "var", "ve", "rstd", "inv_n", "eps"):
        bufs.append(Buffer(b, R, 1, "float32"))
    g = GIRGraph(f"layernorm_{rows}x{n}_{dtype}", Parallel(rows, 4, lanes), tuple(bufs), _numbered(ops),
                 ("x",), ("y",), consts)
    from powerfusion.gir.interpreter import np_dtype
    x = np.random.default_rng(0).standard_normal((rows, n)).astype(np_dtype(dtype))

    def ref(feeds):
        xf = feeds["x"].astype(np.float32).reshape(rows, n)
        m = xf.mean(1, keepdims=True)
        v = ((xf - m) ** 2).mean(1, keepdims=True)
        return {"y": ((xf - m) / np.sqrt(v + eps)).astype(np_dtype(dtype))}
    return Case(g, {"x": x}, ref)


def transpose_tiled(rows: int, cols: int, dtype: str = "float32", lanes: int = 32, tile: int = 32) -> Case:
    """A tiled transpose through SHARED: each group of `tile` units loads a tile's rows,
    a BLOCK sync, then reads the tile's columns."""
    G, S, R = Level.GLOBAL, Level.SHARED, Level.REGISTER
    tr, tc = -(-rows // tile), -(-cols // tile)
    upg = tile
    grp, lu = U // upg, U % upg
    r0, c0 = (grp // tc) * tile, (grp % tc) * tile
    src = MemorySlice("a", G, (r0 + lu) * cols + c0 + J, 1, tile, dtype, 1, (r0 + lu).lt(rows) & (c0 + J).lt(cols))
    sh_w = MemorySlice("tile", S, lu * (tile + 1) + J, 1, tile, dtype)
    sh_r = MemorySlice("tile", S, J * (tile + 1) + lu, 1, tile, dtype)
    dst = MemorySlice("b", G, (c0 + lu) * rows + r0 + J, 1, tile, dtype, 1, (c0 + lu).lt(cols) & (r0 + J).lt(rows))
    ops = [GOp(Move(), (src,), (sh_w,)), GOp(Sync(Scope.BLOCK), (sh_w,), (sh_r,)), GOp(Move(), (sh_r,), (dst,))]
    bufs = (Buffer("a", G, rows * cols, dtype), Buffer("b", G, rows * cols, dtype),
            Buffer("tile", S, tile * (tile + 1), dtype))
    g = GIRGraph(f"transpose_{rows}x{cols}", Parallel(tr * tc * tile, upg, lanes), bufs, _numbered(ops), ("a",), ("b",))
    from powerfusion.gir.interpreter import np_dtype
    a = np.random.default_rng(1).standard_normal((rows, cols)).astype(np_dtype(dtype))
    return Case(g, {"a": a}, lambda f: {"b": np.ascontiguousarray(f["a"].reshape(rows, cols).T)})


def gather_rows(vocab: int, dim: int, count: int, lanes: int = 32) -> Case:
    """Embedding lookup: unit u copies row ids[u] of the table (a `Load` in the index)."""
    from powerfusion.gir.expr import Load
    G, R = Level.GLOBAL, Level.REGISTER
    src = MemorySlice("table", G, Load("ids", U) * dim + J, 1, dim, "float32")
    dst = MemorySlice("out", G, U * dim + J, 1, dim, "float32")
    ops = [GOp(Move(), (src,), (dst,))]
    bufs = (Buffer("table", G, vocab * dim, "float32"), Buffer("ids", G, count, "int64"),
            Buffer("out", G, count * dim, "float32"))
    g = GIRGraph(f"gather_{vocab}x{dim}", Parallel(count, 4, lanes), bufs, _numbered(ops), ("table", "ids"), ("out",))
    rng = np.random.default_rng(2)
    feeds = {"table": rng.standard_normal((vocab, dim)).astype(np.float32),
             "ids": rng.integers(0, vocab, count).astype(np.int64)}
    return Case(g, feeds, lambda f: {"out": f["table"].reshape(vocab, dim)[f["ids"]]})


def roll_rows_add(rows: int, shift: int, lanes: int = 32, vec: int = 4) -> Case:
    """y[u] = x[(u + shift) % rows] + b[u]: the rolled rows come through two masked moves into one
    register tile, each owning the units its register mask names (Swin-T's shifted-window roll,
    a concat of two slices, once rewrites have composed it into the add that reads it)."""
    G, R = Level.GLOBAL, Level.REGISTER
    width = lanes * vec
    num, n = 2, 2 * lanes * vec
    row = I * width + J
    head, tail = (U + shift).lt(rows), (U + shift).ge(rows)
    reg = lambda b, v=None: MemorySlice(b, R, row, num, width, "float32", vec, v)
    ops = [GOp(Move(), (MemorySlice("x", G, (U + shift) * n + row, num, width, "float32", vec, head),), (reg("xr", head),)),
           GOp(Move(), (MemorySlice("x", G, (U + shift - rows) * n + row, num, width, "float32", vec, tail),),
               (reg("xr", tail),)),
           GOp(Move(), (MemorySlice("b", G, U * n + row, num, width, "float32", vec),), (reg("br"),)),
           GOp(Elementwise("add"), (reg("xr"), reg("br")), (reg("yr"),)),
           GOp(Move(), (reg("yr"),), (MemorySlice("y", G, U * n + row, num, width, "float32", vec),))]
    bufs = (Buffer("x", G, rows * n, "float32"), Buffer("b", G, rows * n, "float32"),
            Buffer("y", G, rows * n, "float32"), *(Buffer(b, R, n, "float32") for b in ("xr", "br", "yr")))
    g = GIRGraph(f"roll_rows_add_{rows}x{n}", Parallel(rows, 4, lanes), bufs, _numbered(ops), ("x", "b"), ("y",))
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((rows, n)).astype(np.float32),
             "b": rng.standard_normal((rows, n)).astype(np.float32)}
    return Case(g, feeds, lambda f: {"y": np.roll(f["x"].reshape(rows, n), -shift, axis=0) + f["b"].reshape(rows, n)})


def all_cases(lanes: int = 32) -> list[Case]:
    return [layernorm_rows(6, 200, "float32", lanes), layernorm_rows(5, 768, "float16", lanes, vec=8),
            layernorm_rows(3, 1000, "bfloat16", lanes, vec=8), transpose_tiled(70, 45, lanes=lanes),
            gather_rows(50, 48, 9, lanes), roll_rows_add(14, 11, lanes)]
