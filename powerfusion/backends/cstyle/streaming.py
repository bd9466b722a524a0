"""Streamed row tiles: a long register tile is emitted as one loop over its rows.

The plain rendering gives each register buffer a whole tile per lane and each gOperator its own
fully unrolled loop nest, so a tile lives from its first writer to its last reader. That is
right for tiles of a few dozen slots; a unit owning a long row (LayerNorm over 65536
elements: 2048 slots per lane) spills every slot to local memory.

Here the gOperators that work row by row on tiles of one shape [num x width] -- loads and
stores, elementwise, register moves, broadcast and reduce over num -- run as one loop over
the rows (partly unrolled), each tile reduced to the one row the iteration handles. A tile
read by a later run is re-loaded there when its only writer is a load of a global buffer the
kernel never writes (rematerialisation: one more read of the row, usually from L2, instead of
a spill of it). Kernels whose long tiles cannot all be made row-local keep the plain rendering.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from powerfusion.backends.cstyle.accumulate import accumulator, sumexp_push
from powerfusion.gir.expr import Var, substitute
from powerfusion.gir.ir import Broadcast, Elementwise, GOp, Level, MemorySlice, Move, Reduce

STREAM_SLOTS = 256   # per-lane slots of a tile from which its rows are streamed
UNROLL = 4           # rows per unrolled step of a streamed loop, at least (loads in flight per lane)
IN_FLIGHT = 32       # slots per lane a streamed loop's unrolled step aims to load: a narrow row
                     # (one slot per lane: a split-K finisher over 512 partials) unrolls further
SIMD_SUM_MIN = 32    # a float sum over fewer rows or segments is unrolled, without the dialect's SIMD pragma
SIMD_SUM_SLOTS = 8   # a streamed SIMD sum keeps at most this many slots, one scalar accumulator each


@dataclass(frozen=True)
class Run:
    """Consecutive gOperators streamed over `num` rows of tiles `width` wide."""
    ops: tuple[GOp, ...]        # remat loads first, then the run's own ops
    num: int
    width: int
    local: frozenset[str]       # tiles declared per row inside the loop


def stream_segments(low) -> list | None:
    """The kernel's ops as a list of GOps and Runs, or None when nothing is streamed."""
    L = low.r.lanes
    long_tiles = {b for b, lay in low.reg.items() if not lay.replicated and lay.slots >= STREAM_SLOTS}
    if not long_tiles:
        return None
    shapes = set()
    for op in low.ops:
        for s in op.inputs + op.outputs:
            if s.buffer in long_tiles:
                shapes.add((s.num, s.width))
    if len(shapes) != 1:
        return None
    num, width = shapes.pop()
    if width % L:
        return None
    segments: list = []
    for op in low.ops:
        if _streamable(low, op, num, width, long_tiles):
            if segments and isinstance(segments[-1], list) and segments[-1][0].guard == op.guard:
                segments[-1].append(op)
            else:
                segments.append([op])
        else:
            if any(s.buffer in long_tiles for s in op.inputs + op.outputs):
                return None   # a long tile used outside a streamable op: keep the plain rendering
            segments.append(op)
    segments = _merge_siblings(segments)
    recipes = _recipes(low, long_tiles, num, width)
    out = []
    for seg in segments:
        if not isinstance(seg, list):
            out.append(seg)
            continue
        remat, made = [], set()
        for op in seg:
            for s in op.inputs:
                if s.buffer in long_tiles and s.buffer not in made:
                    recipe = recipes.get(s.buffer)
                    if recipe is None or any(r.guard != op.guard for r in recipe):
                        return None   # read before written here and not recomputable
                    for r in recipe:
                        if r not in remat:
                            remat.append(r)
                            made |= {x.buffer for x in r.outputs}
            made |= {s.buffer for s in op.outputs}
        tiles = frozenset(s.buffer for op in remat + seg for s in op.inputs + op.outputs
                          if s.buffer in long_tiles)
        out.append(Run(tuple(remat + seg), num, width, tiles))
    return out


def _merge_siblings(segments: list) -> list:
    """Let two streamed runs become one when the ops between them neither feed the later run
    nor depend on the earlier one (then the later run moves up, or the earlier one down): two
    reductions over the same rows (a sum and a sum of squares) share one loop and one read of
    the row, and a run whose tile only the last loop reads joins that loop."""
    segments = list(segments)
    i = 0
    while i < len(segments):
        run = segments[i]
        if isinstance(run, list):
            j, between = i + 1, []
            while j < len(segments) and not isinstance(segments[j], list):
                between.append(segments[j])
                j += 1
            if between and j < len(segments) and segments[j][0].guard == run[0].guard:
                if _independent(segments[j], between):     # the later run moves up
                    segments[i] = run + segments[j]
                    del segments[j]
                    continue
                if _independent(run, between):             # or this one moves down
                    segments[j] = run + segments[j]
                    del segments[i]
                    continue
        i += 1
    return segments


def _independent(ops: list[GOp], others: list[GOp]) -> bool:
    """Can `ops` run before `others` (no buffer one side writes is touched by the other)?"""
    def buffers(group, side):
        return {s.buffer for op in group for s in getattr(op, side)}
    w, r = buffers(ops, "outputs"), buffers(ops, "inputs")
    ow, orr = buffers(others, "outputs"), buffers(others, "inputs")
    return not (r & ow or w & orr or w & ow)


def _streamable(low, op: GOp, num: int, width: int, long_tiles) -> bool:
    a = op.args
    slices = op.inputs + op.outputs
    if any(s.level == Level.SHARED for s in slices):
        return False
    if isinstance(a, Reduce) or isinstance(a, Broadcast):
        if a.over != "num":
            return False
        tile, row = (op.inputs[0], op.outputs[0]) if isinstance(a, Reduce) else (op.outputs[0], op.inputs[0])
        return (tile.buffer in long_tiles and (tile.num, tile.width) == (num, width) and row.level == Level.REGISTER
                and row.num == 1 and row.width == width and not low.reg[row.buffer].replicated)
    if not isinstance(a, (Move, Elementwise)):
        return False
    if not any(s.buffer in long_tiles for s in slices):
        return False
    for s in slices:
        if (s.num, s.width) != (num, width):
            return False
        if s.level == Level.REGISTER and s.buffer not in long_tiles:
            return False
    return True


def _recipes(low, long_tiles, num: int, width: int) -> dict[str, list[GOp]]:
    """Tile -> the ops that recompute it in another run (rematerialisation): its only writer,
    a load of a global buffer the kernel never writes or a row-wise op whose other inputs are
    written once (row vectors, constants), after the recipes of its input tiles."""
    writers: dict[str, list[GOp]] = {}
    for op in low.ops:
        for s in op.outputs:
            writers.setdefault(s.buffer, []).append(op)
    memo: dict[str, list[GOp] | None] = {}

    def recipe(b: str, depth: int = 0) -> list[GOp] | None:
        if b in memo:
            return memo[b]
        memo[b] = None   # cycles and failures
        ws = writers.get(b, [])
        if depth > 16 or len(ws) != 1 or not _streamable(low, ws[0], num, width, long_tiles) \
                or isinstance(ws[0].args, Reduce):
            return None
        w, ops = ws[0], []
        for s in w.inputs:
            if s.buffer in long_tiles:
                sub = recipe(s.buffer, depth + 1)
                if sub is None:
                    return None
                ops += [r for r in sub if r not in ops]
            elif len(writers.get(s.buffer, [])) > 1 or (s.level == Level.GLOBAL and s.buffer in writers):
                return None   # changes during the kernel: the value at w's time is gone
        memo[b] = ops + [w]
        return memo[b]

    return {b: r for b in long_tiles if (r := recipe(b)) is not None}


ROW = Var("ri")   # the streamed loop's row (rendered by name)


def row_view(s: MemorySlice, run: Run) -> MemorySlice:
    """The slice as the one row `ri` of the streamed loop (i -> ri, num 1)."""
    if (s.num, s.width) != (run.num, run.width) or s.num == 1:
        return s
    m = {"i": ROW}
    return replace(s, num=1, index=substitute(s.index, m),
                   valid=None if s.valid is None else substitute(s.valid, m))


def render_run(low, run: Run) -> list[str]:
    """C lines of a streamed run (inside the unit's guard, which the caller adds). `low` (the
    kernel.py renderer, which imports this module) renders each gOperator's own lines."""
    L = low.r.lanes
    per = run.width // L
    pre, body, post = [], [], []
    reduces = [op for op in run.ops if isinstance(op.args, Reduce)]
    # the dialect's SIMD sum over the rows (the CPU) where every reduction is a float sum of a
    # few slots: one scalar accumulator a slot (an array-section reduction does not vectorise: a
    # 576 x 1024 GEMV took 0.44 ms with one, 0.04 ms with a scalar; with rows of 4 slots summed
    # into an array, a serial add chain a slot, 0.19 ms against 0.08 with four scalars)
    simd = bool(reduces and low.r.sum_pragma and per <= SIMD_SUM_SLOTS and run.num >= SIMD_SUM_MIN and all(
        op.args.fn == "sum" and low.dtype(op.outputs[0]) in ("float32", "float64") for op in reduces))
    sums = []
    for op in run.ops:
        view = replace(op, inputs=tuple(row_view(s, run) for s in op.inputs),
                       outputs=tuple(row_view(s, run) for s in op.outputs))
        if isinstance(op.args, Reduce) and op.args.fn == "sumexp":
            pre, body, post = _sumexp_run(low, op, view, per, pre, body, post, sumexp_push)
            continue
        if isinstance(op.args, Reduce):
            src, dst = view.inputs[0], view.outputs[0]
            acct, ident, comb = accumulator(low.dtype(dst), op.args.fn)
            acc = low.ident("acc", f"{dst.buffer}_{op.uid}")
            vec = low.reg[src.buffer].vec
            sv = low._valid(src)

            def take(ref: str) -> str:
                line = f"{ref} = {comb.format(a=ref, b=low.ref(src, 's'))};"
                return (f"{{ const int j = ((s / {vec}) * {L} + lane) * {vec} + s % {vec}; if ({sv}) {line} }}"
                        if sv else line)
            if simd:   # slot s in scalar acc (one slot) or acc_s<s>, each statement under its own s
                names = [acc] if per == 1 else [f"{acc}_s{k}" for k in range(per)]
                sums += names
                pre.append(f"{acct} {', '.join(f'{n} = {ident}' for n in names)};")
                body += [f"{{ const int s = {k}; {take(n)} }}" for k, n in enumerate(names)]
                post += [f"{{ const int s = {k}; {low.ref(dst, 's')} = {n}; }}" for k, n in enumerate(names)]
                continue
            pre.append(f"{acct} {acc}[{per}];")
            pre += ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {acc}[s] = {ident};"]
            body += ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {take(f'{acc}[s]')}"]
            post += ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {low.ref(dst, 's')} = {acc}[s];"]
            continue
        body += [f"// gop {op.uid}: {op.describe()} (row ri)", *low.instruction(view)]
    decls = [f"{low.r.ctype[low.graph.buffer(b).dtype]} {low.ident('r', b)}[{per}];" for b in sorted(run.local)]
    unroll = max(UNROLL, min(IN_FLIGHT // max(1, per), run.num))
    pragma = low.r.sum_pragma.replace("(+:acc)", f"(+:{', '.join(sums)})") if simd else f"#pragma unroll {unroll}"
    return [*pre, pragma, f"for (int ri = 0; ri < {run.num}; ++ri) {{",
            *["  " + d for d in decls], *["  " + x for x in body], "}", *post]


def _sumexp_run(low, op: GOp, view: GOp, per: int, pre, body, post, push):
    """A streamed reduce(sumexp): per slot a running max and a rescaled sum across the loop."""
    src, dst = view.inputs[0], view.outputs[0]
    t = "double" if low.dtype(dst) == "float64" else "float"
    m, s = low.ident("am", f"{dst.buffer}_{op.uid}"), low.ident("as", f"{dst.buffer}_{op.uid}")
    L, vec = low.r.lanes, low.reg[src.buffer].vec
    pre = pre + [f"{t} {m}[{per}], {s}[{per}];", "#pragma unroll",
                 f"for (int s = 0; s < {per}; ++s) {{ {m}[s] = -INFINITY; {s}[s] = ({t})0; }}"]
    take = push(f"{m}[s]", f"{s}[s]", low.ref(src, "s"), low.dtype(dst))
    sv = low._valid(src)
    if sv:
        take = f"{{ const int j = ((s / {vec}) * {L} + lane) * {vec} + s % {vec}; if ({sv}) {take} }}"
    body = body + ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {take}"]
    post = post + ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {low.ref(dst, 's')} = {s}[s];"]
    return pre, body, post
