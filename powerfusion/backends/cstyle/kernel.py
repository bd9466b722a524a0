"""Rendering of one kernel's gOperators to C lines (the instruction mapping of the C-style renderer).

Each gOperator kind has one method `_<kind>` that returns its lines; adding a kind
touches this table only (INSTRUCTIONS at the bottom)."""
from __future__ import annotations

from powerfusion.names import UniqueNames

from dataclasses import dataclass

import math

import numpy as np

from powerfusion.backends.source import KernelSource, RenderError, op_line_ranges
from powerfusion.backends.cstyle.accumulate import accumulator, sumexp_push
from powerfusion.backends.cstyle.faults import FAULTING, INTEGER_DTYPES, fault_line
from powerfusion.backends.cstyle.index import render_index
from powerfusion.backends.cstyle.inlane import in_lane_assignments, in_lane_slice
from powerfusion.backends.cstyle.streaming import SIMD_SUM_MIN, Run, render_run, stream_segments
from powerfusion.gir.expr import BinOp, Expr, affine_coefficient, loads, substitute, Const, I, J, U, variables
from powerfusion.gir.ir import (Broadcast, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Reduce, Scope, Sync)
from powerfusion.gir.interpreter import np_dtype

_U = U
FEW_UNITS = 1024   # a kernel with at most this many units launches one unit per group (see units_per_group)


def c_float(x: float) -> str:
    if math.isnan(x):
        return "(__int_as_float(0x7fc00000))"
    if math.isinf(x):
        return "(-INFINITY)" if x < 0 else "(INFINITY)"
    return f"{float(x)!r}f"


@dataclass(frozen=True)
class RegLayout:
    """How one REGISTER buffer is spread over the lanes of its unit."""
    width: int
    vec: int
    replicated: bool
    slots: int  # per lane


class KernelRenderer:
    def __init__(self, renderer, graph: GIRGraph, ops: tuple[GOp, ...], name: str):
        self.r, self.graph, self.ops, self.name = renderer, graph, ops, name
        self.P = graph.parallel
        if self.P.lanes != renderer.lanes:
            raise _err(f"GIR graph {graph.name} was planned for {self.P.lanes} lanes per unit, "
                       f"the target has {renderer.lanes}")
        from powerfusion.names import sanitize
        self.sanitize = sanitize
        self._names = UniqueNames()
        self.reg = self._register_layouts()
        self.faults: list[str] = []   # the fault table's lines (see fault_line)
        self.smem_offsets, self.shared_bytes = self._shared_layout()

    # ---- layouts ------------------------------------------------------------------
    def _register_layouts(self) -> dict[str, RegLayout]:
        out: dict[str, RegLayout] = {}
        L = self.r.lanes
        for op in self.ops:
            for s in op.inputs + op.outputs:
                if s.level != Level.REGISTER:
                    continue
                if not _identity_layout(s) and not _in_lane_move(op):
                    raise _err(f"register slice {s.describe()} of '{op.describe()}' is not in identity layout")
                buf = self.graph.buffer(s.buffer)
                if s.width == 1:
                    lay = RegLayout(1, 1, True, buf.size)
                else:
                    if s.width % (L * s.vec):
                        raise _err(f"register slice {s.describe()} width {s.width} is not a multiple of "
                                   f"lanes x vec = {L}x{s.vec}")
                    lay = RegLayout(s.width, s.vec, False, -(-buf.size // s.width) * (s.width // L))
                prev = out.get(s.buffer)
                if prev and prev != lay:
                    raise _err(f"register buffer '{s.buffer}' is used with two layouts: {prev} and {lay}")
                out[s.buffer] = lay
        return out

    def _shared_layout(self):
        offs, total = {}, 0
        for op in self.ops:
            for s in op.inputs + op.outputs:
                if s.level == Level.SHARED and s.buffer not in offs:
                    b = self.graph.buffer(s.buffer)
                    total = -(-total // 16) * 16
                    offs[s.buffer] = total
                    total += b.size * np_dtype(b.dtype).itemsize
        return offs, total

    # ---- names ----------------------------------------------------------------------
    def ident(self, prefix: str, buf: str) -> str:
        return self._names.ident(prefix, buf)

    def ptr(self, buf: str) -> str:
        return self.ident("p", buf)

    def ref(self, s: MemorySlice, addr: str) -> str:
        if s.level == Level.GLOBAL:
            return f"{self.ptr(s.buffer)}[{addr}]"
        if s.level == Level.SHARED:
            return f"{self.ident('s', s.buffer)}[{addr}]"
        return f"{self.ident('r', s.buffer)}[{addr}]"

    def expr(self, e: Expr) -> str:
        e = _simplified(self, e)   # index arithmetic folded under the ranges it runs in (gir/simplify.py)
        return render_index(e, {"u": "u", "i": "i", "j": "j"},
                            load=lambda b, idx: f"((idx_t){self.ptr(b)}[{idx}])", floor=_floor_ops,
                            checked=self._checked_index if self.r.device_faults else None)

    def _checked_index(self, x: Expr, n: int) -> str:
        """A gathered index checked in the kernel: out of [-n, n) records a fault (the host
        raises a DataError naming the gather); the value used is clamped, as before."""
        from powerfusion.gir.expr import Load
        def render(e):
            return render_index(e, {"u": "u", "i": "i", "j": "j"}, self._idx_load, _floor_ops,
                                checked=self._checked_index)
        # a loaded index as its raw 64-bit value: a cast to a 32-bit idx_t could wrap it into range
        src = f"((long long){self.ptr(x.buffer)}[{render(x.index)}])" if isinstance(x, Load) else render(x)
        buffer = sorted(loads(x))[0]
        self.faults.append(fault_line(len(self.faults) + 1, "index", buffer, str(n)))
        return f"pf_checked_index({src}, {n}LL, {len(self.faults)}u)"

    def _idx_load(self, b: str, idx: str) -> str:
        return f"((idx_t){self.ptr(b)}[{idx}])"

    def dtype(self, s: MemorySlice) -> str:
        return self.graph.buffer(s.buffer).dtype

    # ---- element iteration ----------------------------------------------------------
    def _lane_loop(self, s: MemorySlice, body: list[str]) -> list[str]:
        """Loops over the elements (i, j) of slice s that this lane handles; defines i, j and,
        for register slices, `slot`."""
        L = self.r.lanes
        if s.level == Level.REGISTER:
            lay = self.reg[s.buffer]
            if lay.replicated:
                return ["#pragma unroll", f"for (int i = 0; i < {s.num}; ++i) {{ const int j = 0; const int slot = i;",
                        *["  " + b for b in body], "}"]
            per = s.width // (L * lay.vec)
            return ["#pragma unroll", f"for (int i = 0; i < {s.num}; ++i)", "#pragma unroll",
                    f"for (int c = 0; c < {per}; ++c)", "#pragma unroll", f"for (int v = 0; v < {lay.vec}; ++v) {{",
                    f"  const int j = (c * {L} + lane) * {lay.vec} + v;",
                    f"  const int slot = i * {s.width // L} + c * {lay.vec} + v;", *["  " + b for b in body], "}"]
        vec = s.vec
        return [f"for (int i = 0; i < {s.num}; ++i)",
                f"for (int j0 = lane * {vec}; j0 < {s.width}; j0 += {L * vec})", "#pragma unroll",
                f"for (int v = 0; v < {vec}; ++v) {{ const int j = j0 + v; if (j < {s.width}) {{",
                *["  " + b for b in body], "}}"]

    def _addr_in(self, s: MemorySlice, other: MemorySlice) -> str:
        """Address in `s` of the element with the same row-major position as (i, j) of `other`."""
        if s.num == other.num and s.width == other.width:
            return self.expr(s.index)
        k = f"((idx_t)i * {other.width} + j)"
        e = substitute(s.index, {"i": _Raw(f"({k} / {s.width})"), "j": _Raw(f"({k} % {s.width})")})
        return self.expr(e)

    def _fill(self, x: float, sdt: str, ddt: str) -> str:
        """A masked-off element's value in `ddt`: 16-bit float fills are written as float
        literals and converted, so `cond ? half : fill` has one type on both sides."""
        lit = "float32" if sdt in self.r.to_float else sdt   # 16-bit floats, the CPU's float4 codes
        return self.r.convert(_fill_literal(x, lit), lit, ddt)

    def _valid(self, s: MemorySlice) -> str | None:
        return None if s.valid is None else self.expr(s.valid)

    # ---- gOperator kinds -------------------------------------------------------------
    def _move(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        if src.level == Level.REGISTER and dst.level == Level.REGISTER:
            if _in_lane_move(op) and not (_identity_layout(src) and _identity_layout(dst)):
                return self._in_lane_move(op)
            if self.reg[src.buffer] != self.reg[dst.buffer] or src.count != dst.count:
                raise _err(f"register move between layouts needs a WARP exchange: {op.describe()}")
        fast = self._vector_move(op) or self._vector_copy(op)
        if fast:
            return fast
        # iterate over the elements this lane owns: the register side decides, else the source
        lead = src if src.level == Level.REGISTER or dst.level != Level.REGISTER else dst
        sdt, ddt = self.dtype(src), self.dtype(dst)

        def addr(s: MemorySlice) -> str:
            if s.level == Level.REGISTER:
                return "slot"
            return self.expr(s.index) if s is lead else self._addr_in(s, lead)

        val = self.r.convert(self.ref(src, addr(src)), sdt, ddt)
        sv, dv = self._valid(src), self._valid(dst)
        if sv:
            val = f"({sv}) ? {val} : {self._fill(src.fill, sdt, ddt)}"
        store = f"{self.ref(dst, addr(dst))} = {val};"
        lines = self._lane_loop(lead, [f"if ({dv}) {store}" if dv else store])
        if lead.level == Level.REGISTER and self.reg[lead.buffer].replicated and dst.level != Level.REGISTER:
            lines = ["if (lane == 0) {", *lines, "}"]  # a replicated value is stored once
        return lines

    def _in_lane_move(self, op: GOp) -> list[str]:
        """A register -> register move that changes the pattern inside each lane (inlane.py):
        one assignment per slot, the same in every lane."""
        (src,), (dst,) = op.inputs, op.outputs
        lay, slay = self.reg[dst.buffer], self.reg[src.buffer]
        same = (lay.width, lay.vec, lay.replicated) == (slay.width, slay.vec, slay.replicated)
        pairs = in_lane_assignments(src, dst, lay.width, lay.vec, self.r.lanes) if same else None
        if pairs is None:
            raise _err(f"register move between patterns needs a WARP exchange: {op.describe()}")
        sdt, ddt = self.dtype(src), self.dtype(dst)
        fill = self._fill(src.fill, sdt, ddt)
        return [f"{self.ref(dst, str(d))} = "
                f"{self.r.convert(self.ref(src, str(s)), sdt, ddt) if s is not None else fill};" for d, s in pairs]

    def _vector_move(self, op: GOp) -> list[str] | None:
        """16/8/4-byte accesses between a contiguous aligned global slice and registers. Both
        slices' masks count: the global one says which elements exist there, the register one
        which register elements this move owns (two masked moves may fill one register tile,
        each its own rows: a concat read through composed moves), so a vector is taken whole
        only where every element passes both, and the element path writes only owned slots."""
        (src,), (dst,) = op.inputs, op.outputs
        glob, reg = (src, dst) if src.level == Level.GLOBAL else (dst, src)
        if not (glob.level == Level.GLOBAL and reg.level == Level.REGISTER):
            return None
        lay = self.reg[reg.buffer]
        vec = glob.vec
        nbytes = vec * np_dtype(self.dtype(glob)).itemsize
        if lay.replicated or vec != lay.vec or nbytes not in self.r.vector_type or vec == 1:
            return None
        if glob.num != reg.num or glob.width != reg.width or not _aligned(glob.index, vec):
            return None
        L = self.r.lanes
        gdt, rdt = self.dtype(glob), self.dtype(reg)
        vt = self.r.vector_type[nbytes]
        per = glob.width // (L * vec)
        gv, rv = self._valid(glob), self._valid(reg)
        gaddr = self.expr(substitute(glob.index, {"j": _Raw("j0")}))
        lines = ["#pragma unroll", f"for (int i = 0; i < {glob.num}; ++i)", "#pragma unroll",
                 f"for (int c = 0; c < {per}; ++c) {{",
                 f"  const int j0 = (c * {L} + lane) * {vec}; const int slot0 = i * {glob.width // L} + c * {vec};",
                 f"  const idx_t a0 = {gaddr};"]
        ok = "true"
        both = " && ".join(f"({m})" for m in (gv, rv) if m)
        if both:
            lines.append("  bool ok = true;")
            lines.append("  #pragma unroll")
            lines.append(f"  for (int v = 0; v < {vec}; ++v) {{ const int j = j0 + v; ok = ok && {both}; }}")
            ok = "ok"
        gt = self.r.ctype[gdt]
        elem = self.expr(substitute(glob.index, {"j": _Raw("(j0 + v)")}))
        if glob is src:
            fill = self._fill(src.fill, gdt, rdt)
            lines += [f"  if ({ok}) {{ {gt} t[{vec}]; *reinterpret_cast<{vt}*>(t) = "
                      f"*reinterpret_cast<const {vt}*>(&{self.ptr(glob.buffer)}[a0]);",
                      "    #pragma unroll", f"    for (int v = 0; v < {vec}; ++v) "
                      f"{self.ref(reg, 'slot0 + v')} = {self.r.convert('t[v]', gdt, rdt)}; }}"]
            if both:
                load = self.r.convert(f"{self.ptr(glob.buffer)}[{elem}]", gdt, rdt)
                val = f"({gv}) ? {load} : {fill}" if gv else load
                owned = f"if ({rv}) " if rv else ""
                lines += [f"  else {{ for (int v = 0; v < {vec}; ++v) {{ const int j = j0 + v; "
                          f"{owned}{self.ref(reg, 'slot0 + v')} = {val}; }} }}"]
        else:
            lines += [f"  if ({ok}) {{ {gt} t[{vec}];", "    #pragma unroll",
                      f"    for (int v = 0; v < {vec}; ++v) t[v] = {self.r.convert(self.ref(reg, 'slot0 + v'), rdt, gdt)};",
                      f"    *reinterpret_cast<{vt}*>(&{self.ptr(glob.buffer)}[a0]) = *reinterpret_cast<{vt}*>(t); }}"]
            if both:
                val = self.r.convert(self.ref(reg, 'slot0 + v'), rdt, gdt)
                if rv:   # a register element outside its mask is stored as the fill (as the interpreter does)
                    val = f"({rv}) ? {val} : {self._fill(src.fill, rdt, gdt)}"
                stored = f"if ({gv}) " if gv else ""
                lines += [f"  else {{ for (int v = 0; v < {vec}; ++v) {{ const int j = j0 + v; {stored}"
                          f"{self.ptr(glob.buffer)}[{elem}] = {val}; }} }}"]
        lines.append("}")
        return lines

    def _vector_copy(self, op: GOp) -> list[str] | None:
        """16/8/4-byte copies between two contiguous aligned global slices of one dtype (a
        transpose of whole rows, a channel shuffle's planes): one vector load and store per
        lane and segment, unrolled; a vector with a masked element takes the element path."""
        (src,), (dst,) = op.inputs, op.outputs
        if src.level != Level.GLOBAL or dst.level != Level.GLOBAL or not vector_copy_ok(src, dst, self.r.lanes):
            return None
        nbytes = src.vec * np_dtype(self.dtype(src)).itemsize
        if nbytes not in self.r.vector_type:
            return None
        L, vec, vt = self.r.lanes, src.vec, self.r.vector_type[nbytes]
        sv, dv = self._valid(src), self._valid(dst)
        at_j0 = {"j": _Raw("j0")}
        lines = ["#pragma unroll", f"for (int i = 0; i < {src.num}; ++i)", "#pragma unroll",
                 f"for (int c = 0; c < {src.width // (L * vec)}; ++c) {{",
                 f"  const int j0 = (c * {L} + lane) * {vec};",
                 f"  const idx_t a0 = {self.expr(substitute(src.index, at_j0))};",
                 f"  const idx_t d0 = {self.expr(substitute(dst.index, at_j0))};"]
        ok = "true"
        if sv or dv:   # each element's masks evaluated once: for the vector test and the element path
            lines += [f"  bool ms[{vec}], md[{vec}]; bool ok = true;", "  #pragma unroll",
                      f"  for (int v = 0; v < {vec}; ++v) {{ const int j = j0 + v; ms[v] = {sv or 'true'}; "
                      f"md[v] = {dv or 'true'}; ok = ok && ms[v] && md[v]; }}"]
            ok = "ok"
        sp, dp = self.ptr(src.buffer), self.ptr(dst.buffer)
        lines.append(f"  if ({ok}) *reinterpret_cast<{vt}*>(&{dp}[d0]) = *reinterpret_cast<const {vt}*>(&{sp}[a0]);")
        if sv or dv:
            fill = self._fill(src.fill, self.dtype(src), self.dtype(dst))
            lines.append(f"  else {{ for (int v = 0; v < {vec}; ++v) if (md[v]) {dp}[d0 + v] = "
                         f"ms[v] ? {sp}[a0 + v] : {fill}; }}")
        lines.append("}")
        return lines

    def _elementwise(self, op: GOp) -> list[str]:
        out = op.outputs[0]
        for s in op.inputs:
            if s.level != Level.REGISTER or self.reg[s.buffer] != self.reg[out.buffer] or s.count != out.count:
                raise _err(f"elementwise operands must share the output's register layout: {op.describe()}")
        odt = self.dtype(out)
        operands = []
        for s in op.inputs:
            dt = self.dtype(s)
            ref = self.ref(s, "slot")
            # stored types that compute as float (16-bit floats; the CPU's float4 codes)
            operands.append(self.r.convert(ref, dt, "float32") if dt in self.r.to_float else ref)
        fn = op.args.fn
        if fn in FAULTING and odt in INTEGER_DTYPES and self.r.device_faults:
            site = self._fault_site(fn, op.origin, odt)
            val = f"pf_checked_{fn}<{self.r.ctype[odt]}>({operands[0]}, {operands[1]}, {site}u)"
        else:
            val = self.r.scalar(fn, dict(op.args.params), operands, odt)
        return self._lane_loop(out, [f"{self.ref(out, 'slot')} = {val};"])

    def _fault_site(self, fn: str, origin: str, dtype: str) -> int:
        """A new run-time fault site's code (1, 2, ...), listed in the source's fault table."""
        self.faults.append(fault_line(len(self.faults) + 1, fn, origin, dtype))
        return len(self.faults)

    def _reduce(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        fn = op.args.fn
        if fn == "sumexp":
            return self._sumexp(op)
        acct, ident, comb = accumulator(self.dtype(dst), fn)
        lay = self.reg[src.buffer]
        L = self.r.lanes
        sv = self._valid(src)
        if op.args.over == "width":
            if lay.replicated:
                return self._lane_loop(dst, [f"{self.ref(dst, 'slot')} = {self.ref(src, 'slot')};"])
            per = src.width // (L * lay.vec)
            take = comb.format(a="acc", b=self.ref(src, "slot"))
            upd = f"if ({sv}) acc = {take};" if sv else f"acc = {take};"
            lines = ["#pragma unroll", f"for (int i = 0; i < {src.num}; ++i) {{", f"  {acct} acc = {ident};",
                     "  #pragma unroll", f"  for (int c = 0; c < {per}; ++c)", "  #pragma unroll",
                     f"  for (int v = 0; v < {lay.vec}; ++v) {{ const int j = (c * {L} + lane) * {lay.vec} + v; "
                     f"const int slot = i * {src.width // L} + c * {lay.vec} + v; {upd} }}"]
            m = L // 2
            while m >= 1:
                # the partner's value first: an integer max/min combine is a conditional
                # expression, and a shuffle under it would run on only some lanes
                lines.append(f"  {{ const {acct} o = {self.r.shfl_xor('acc', m)}; acc = {comb.format(a='acc', b='o')}; }}")
                m //= 2
            lines += [f"  {self.ref(dst, 'i')} = acc;", "}"]
            return lines
        # over num: each lane combines its own slots down the segments
        if lay.replicated:
            inner = [f"acc = {comb.format(a='acc', b=self.ref(src, 'i'))};"]
            return [f"{{ {acct} acc = {ident};", self._num_pragma(fn, acct, src.num, 1), f"for (int i = 0; i < {src.num}; ++i) "
                    + (f"{{ const int j = 0; if ({sv}) {inner[0]} }}" if sv else inner[0]),
                    f"{self.ref(dst, '0')} = acc; }}"]
        per = src.width // L
        body = f"acc = {comb.format(a='acc', b=self.ref(src, f'i * {per} + s'))};"
        if sv:
            body = (f"{{ const int j = ((s / {lay.vec}) * {L} + lane) * {lay.vec} + s % {lay.vec}; "
                    f"if ({sv}) {body} }}")
        return ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {{ {acct} acc = {ident};",
                "  " + self._num_pragma(fn, acct, src.num, per), f"  for (int i = 0; i < {src.num}; ++i) {body}",
                f"  {self.ref(dst, 's')} = acc; }}"]

    def _num_pragma(self, fn: str, acct: str, num: int, stride: int) -> str:
        """The pragma before a reduction's loop down the segments: the dialect's `sum_pragma`
        for a float sum of at least SIMD_SUM_MIN contiguous segments where it has one (the CPU
        lets the compiler reorder that sum into SIMD partial sums; a serial chain of float adds
        waits an add's latency per element). Short or strided loops are left to unrolling: gcc's
        SIMD form made a 576-channel 7x7 average pool's 7-segment guarded sum 8x slower
        (83 vs 10 us) and a 240-channel 14x14 one's 49 segments 4 apart 2.4x (14 vs 6 us)."""
        if fn == "sum" and acct in ("float", "double") and self.r.sum_pragma and num >= SIMD_SUM_MIN \
                and stride == 1:
            return self.r.sum_pragma
        return "#pragma unroll"

    def _sumexp(self, op: GOp) -> list[str]:
        """reduce(sumexp) over num: per slot a running max and a rescaled sum (sumexp_push)."""
        (src,), (dst,) = op.inputs, op.outputs
        if op.args.over != "num" or self.dtype(dst) not in ("float32", "float64"):
            raise RenderError(f"reduce(sumexp) over {op.args.over} into {self.dtype(dst)} has no rendering")
        t = "double" if self.dtype(dst) == "float64" else "float"
        lay, L, sv = self.reg[src.buffer], self.r.lanes, self._valid(src)
        start = f"{t} am = -INFINITY, as = ({t})0;"
        if lay.replicated:
            push = sumexp_push("am", "as", self.ref(src, "i"), self.dtype(dst))
            body = f"{{ const int j = 0; if ({sv}) {push} }}" if sv else push
            return [f"{{ {start}", "#pragma unroll", f"for (int i = 0; i < {src.num}; ++i) {body}",
                    f"{self.ref(dst, '0')} = as; }}"]
        per = src.width // L
        body = sumexp_push("am", "as", self.ref(src, f"i * {per} + s"), self.dtype(dst))
        if sv:
            body = (f"{{ const int j = ((s / {lay.vec}) * {L} + lane) * {lay.vec} + s % {lay.vec}; "
                    f"if ({sv}) {body} }}")
        return ["#pragma unroll", f"for (int s = 0; s < {per}; ++s) {{ {start}", "  #pragma unroll",
                f"  for (int i = 0; i < {src.num}; ++i) {body}", f"  {self.ref(dst, 's')} = as; }}"]

    def _broadcast(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        per = dst.width // self.r.lanes if not self.reg[dst.buffer].replicated else 1
        if op.args.over == "width":
            return self._lane_loop(dst, [f"{self.ref(dst, 'slot')} = {self.ref(src, 'i')};"])
        return self._lane_loop(dst, [f"{self.ref(dst, 'slot')} = {self.ref(src, f'slot % {per}')};"])

    def _sync(self, op: GOp) -> list[str]:
        scope = op.args.scope
        if scope == Scope.LANE:
            return []
        if scope == Scope.WARP:
            return [f"{self.r.warp_sync};"]
        if scope == Scope.BLOCK:
            return [f"{self.r.barrier};"]
        raise _err("a DEVICE sync inside a kernel (kernels are split at DEVICE syncs)")

    def instruction(self, op: GOp) -> list[str]:
        """C lines of one gOperator (INSTRUCTIONS: its kind's method)."""
        return getattr(self, INSTRUCTIONS[type(op.args)])(op)   # by name: dialects may override one

    # ---- assembly -------------------------------------------------------------------------
    def render(self):
        body = []
        segments = stream_segments(self)
        streamed = {b for seg in segments or () if isinstance(seg, Run) for b in seg.local}
        for op in segments or self.ops:
            if isinstance(op, Run):
                lines, head = render_run(self, op), op.ops[0]
                guard = "unit_live" + (f" && ({self.expr(head.guard)})" if head.guard is not None else "")
                body.append(f"// streamed over {op.num} rows: gops {', '.join(str(o.uid) for o in op.ops)}")
                body += [f"if ({guard}) {{", *["  " + x for x in lines], "}"]
                continue
            lines = self.instruction(op)
            if not lines:
                continue
            guard = "unit_live" + (f" && ({self.expr(op.guard)})" if op.guard is not None else "")
            body.append(f"// gop {op.uid}: {op.describe()}")
            if isinstance(op.args, Sync):
                body += lines
            else:
                body += [f"if ({guard}) {{", *["  " + x for x in lines], "}"]
        decls = []
        for buf, lay in self.reg.items():
            if buf in streamed:
                continue
            b = self.graph.buffer(buf)
            decls.append(f"{self.r.ctype[b.dtype]} {self.ident('r', buf)}[{lay.slots}];")
        for buf, off in self.smem_offsets.items():
            b = self.graph.buffer(buf)
            decls.append(f"{self.r.ctype[b.dtype]}* {self.ident('s', buf)} = "
                         f"{self.r.ptr_cast(self.r.ctype[b.dtype], f'pf_smem + {off}')};")
        used, written = [], set()
        for op in self.ops:
            for s in op.inputs + op.outputs:
                if s.level == Level.GLOBAL and s.buffer not in used:
                    used.append(s.buffer)
                from powerfusion.gir.expr import loads
                for lb in loads(s.index) | (loads(s.valid) if s.valid is not None else frozenset()):
                    if lb not in used:
                        used.append(lb)
            for s in op.outputs:
                if s.level == Level.GLOBAL:
                    written.add(s.buffer)
        params, plist = [], []
        for bname in used:
            b = self.graph.buffer(bname)
            const = "" if bname in written else "const "
            params.append(f"{const}{self.r.ctype[b.dtype]}* {self.r.restrict} {self.ptr(bname)}")
            plist.append((bname, b.dtype, bname in written))
        big = max((self.graph.buffer(b).size for b in used), default=0) >= 2**31 - 1 or \
            self.P.units * self.r.lanes >= 2**31 - 1
        units = self.live_units()
        upg = self.units_per_group(units)
        threads = upg * self.r.lanes
        groups = -(-units // upg)
        src = self.r.env.get_template(self.r.skeleton).render(
            header=self.r.header, graph_name=self.sanitize(self.graph.name), name=self.name,
            index_type="long long" if big else "int", kernel_prefix=self.r.kernel_prefix,
            launch_bounds=self.r.launch_bounds.format(threads=threads), params=params, lanes=self.r.lanes,
            units_per_group=upg, units=units, shared_bytes=self.shared_bytes,
            declarations=decls, body=body, faults=self.faults)
        src = self.r.trim_headers(src)
        op_lines = op_line_ranges(src)
        return KernelSource(self.name, src, (groups, 1, 1), (threads, 1, 1), self.shared_bytes,
                            tuple(plist), op_lines)


    def units_per_group(self, units: int) -> int:
        """The plan's group size, or one unit per group for a kernel of few units that shares
        nothing within a group (no shared memory, no BLOCK sync): 48 rows of a softmax then run
        on 48 SMs instead of 12."""
        upg = self.P.units_per_group
        shares = self.shared_bytes or any(isinstance(op.args, Sync) and op.args.scope == Scope.BLOCK
                                          for op in self.ops)
        return 1 if units <= FEW_UNITS and not shares else upg

    def live_units(self) -> int:
        """Units this kernel needs: the largest bound on u that every gOperator's guard implies
        (a kernel of a multi-kernel graph often works on a few units of the graph's grid, e.g. a
        softmax over 48 rows after a GEMV over 196608; launching the rest as empty blocks costs
        microseconds). The graph's unit count where some gOperator's guard does not bound u."""
        bound = 0
        for op in self.ops:
            if isinstance(op.args, Sync):
                continue
            b = unit_bound(op.guard) if op.guard is not None else None
            if b is None:
                return self.P.units
            bound = max(bound, min(b, self.P.units))
        return max(bound, 1) if self.ops else self.P.units


def unit_bound(guard: Expr) -> int | None:
    """An exclusive upper bound on u implied by `guard` (a conjunction whose terms may be
    `u < c` / `u <= c`), or None when it implies none."""
    if isinstance(guard, BinOp):
        if guard.op in ("lt", "le") and guard.a == _U and isinstance(guard.b, Const):
            return guard.b.value + (guard.op == "le")
        if guard.op == "and":
            bounds = [b for b in (unit_bound(guard.a), unit_bound(guard.b)) if b is not None]
            return min(bounds) if bounds else None
    return None


INSTRUCTIONS = {Move: "_move", Elementwise: "_elementwise", Reduce: "_reduce", Broadcast: "_broadcast",
                Sync: "_sync"}


class _Raw(Expr):
    """A C fragment spliced into an expression (renderer-internal only)."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


def _aligned(index: Expr, vec: int) -> bool:
    """True when index(u, i, j0) is a multiple of vec whenever j0 is: index = rest(u, i) + j
    (coefficient 1 in j, j nowhere else) with rest a multiple of vec by its form (affine with
    coefficients divisible by vec, or sums of products with such constants: the rows-split
    tilings address floordiv(u, g) * row + mod(u, g) * chunk)."""
    if variables(index) - {"u", "i", "j", "ri"}:   # ri: a streamed loop's row (streaming.py)
        return False
    if affine_coefficient(index, "j") != 1:
        return _lane_vector(index, vec)
    rest = substitute(index, {"j": Const(0)})
    cu, ci = affine_coefficient(rest, "u"), affine_coefficient(rest, "i")
    if cu is not None and ci is not None:
        c0 = substitute(rest, {"u": Const(0), "i": Const(0)})
        if isinstance(c0, Const) and c0.value % vec == 0 and ci % vec == 0 and cu % vec == 0:
            return True
    return _multiple_of(rest, vec)


def vector_copy_ok(src: MemorySlice, dst: MemorySlice, lanes: int) -> bool:
    """Can a global -> global move of these slices be rendered as vector copies? One dtype,
    one vector width > 1, one tile shape of whole lane chunks, both sides contiguous and
    aligned in j (the cost model asks the same question through cstyle/cost.py)."""
    vec = src.vec
    return (vec > 1 and dst.vec == vec and src.dtype == dst.dtype and src.num == dst.num
            and src.width == dst.width and src.width % (lanes * vec) == 0
            and _aligned(src.index, vec) and _aligned(dst.index, vec))


def _lane_vector(index: Expr, vec: int) -> bool:
    """index = rest + j % vec, j in rest only as j // vec, rest a multiple of vec by its form: a
    lane's vec elements (j0 ... j0 + vec - 1, j0 a multiple of vec) are then consecutive from an
    aligned start, whatever rest does between lanes (a flat tiling's lanes may cross rows and
    planes: an involution's per-position kernels, docs/gir.md)."""
    terms = _add_terms(index)
    lane = BinOp("mod", J, Const(vec))
    if terms.count(lane) != 1:
        return False
    rest = [t for t in terms if t != lane]
    quotient = BinOp("floordiv", J, Const(vec))
    return all(_j_only_as(t, quotient) and _multiple_of(t, vec) for t in rest)


def _add_terms(e: Expr) -> list[Expr]:
    if isinstance(e, BinOp) and e.op == "add":
        return _add_terms(e.a) + _add_terms(e.b)
    return [e]


def _j_only_as(e: Expr, quotient: Expr) -> bool:
    """Does j occur in `e` only inside `quotient` (j // vec)?"""
    if e == quotient or "j" not in variables(e):
        return True
    if isinstance(e, BinOp):
        return _j_only_as(e.a, quotient) and _j_only_as(e.b, quotient)
    return False


def _multiple_of(e: Expr, n: int) -> bool:
    """Is e a multiple of n for every value of its variables (judged by its form)?"""
    if isinstance(e, Const):
        return e.value % n == 0
    if isinstance(e, BinOp):
        if e.op in ("add", "sub"):
            return _multiple_of(e.a, n) and _multiple_of(e.b, n)
        if e.op == "mul":
            return _multiple_of(e.a, n) or _multiple_of(e.b, n)
        if e.op == "mod":   # a - floor(a / b) * b
            return _multiple_of(e.a, n) and _multiple_of(e.b, n)
    return False


def _fill_literal(x: float, dtype: str) -> str:
    if dtype == "bool":   # a max's -inf pad is false, a min's +inf true
        return "true" if x > 0 or (x != 0 and not np.isinf(x)) else "false"
    if dtype.startswith("int") or dtype.startswith("uint"):
        return str(int(x))
    return c_float(x)


def _err(msg):
    return RenderError(msg)


def _in_lane_move(op: GOp) -> bool:
    """A register -> register move whose slices inlane.py may render (checked there in full)."""
    return isinstance(op.args, Move) and all(in_lane_slice(s) for s in op.inputs + op.outputs)


def _identity_layout(s: MemorySlice) -> bool:
    """Register tiles are stored row-major: index(i, j) == i * width + j for every element."""
    if s.index == I * s.width + J:
        return True
    if variables(s.index) - {"i", "j"}:
        return False
    i, j = np.meshgrid(np.arange(s.num), np.arange(s.width), indexing="ij")
    from powerfusion.gir.expr import evaluate
    got = np.broadcast_to(evaluate(s.index, {"i": i, "j": j}), i.shape)
    return bool(np.array_equal(got, i * s.width + j))


def _floor_ops(op: str, a: str, b: str) -> str:
    """GIR's // and % round toward minus infinity; C's toward zero. Rewritten offsets can go
    negative, so the floored forms are used (one extra compare for a constant divisor)."""
    return f"pf_floordiv({a}, {b})" if op == "floordiv" else f"pf_mod({a}, {b})"


def _simplified(low: KernelRenderer, e: Expr) -> Expr:
    """`e` simplified where the kernel evaluates it: every expression under `unit_live` (u below
    the unit count), i and j (and a streamed loop's row ri) below the kernel's largest num and
    width. An expression that is the index or valid of its op's slices, in one context for all
    of them, also gets that slice's num and width and its op's guard; an index also its slice's
    valid (an address is used only where its slice is valid: a move selects or stores under it)."""
    from powerfusion.gir.simplify import simplify
    ctx = getattr(low, "_simplify_ctx", None)
    if ctx is None:
        slices = [(op, s) for op in low.ops for s in op.inputs + op.outputs]
        num = max((s.num for _, s in slices), default=1)
        width = max((s.width for _, s in slices), default=1)
        kernel = {"u": (0, low.P.units), "i": (0, num), "ri": (0, num), "j": (0, width)}
        seen: dict = {}
        for op, s in slices:
            local = {**kernel, "i": (0, s.num), "ri": (0, s.num), "j": (0, s.width)}
            where = [c for c in (op.guard, s.valid) if c is not None]
            seen.setdefault(s.index, set()).add((tuple(sorted(local.items())), tuple(where)))
            if s.valid is not None:
                under = (op.guard,) if op.guard is not None else ()
                seen.setdefault(s.valid, set()).add((tuple(sorted(local.items())), under))
        ctx = low._simplify_ctx = (kernel, {k: v.pop() for k, v in seen.items() if len(v) == 1}, {})
    kernel, known, done = ctx
    if e not in done:
        if e not in known:
            done[e] = simplify(e, kernel)
        else:
            local, where = known[e]
            assume = None
            for c in where:
                assume = c if assume is None else BinOp("and", assume, c)
            done[e] = simplify(e, dict(local), assume)
    return done[e]
