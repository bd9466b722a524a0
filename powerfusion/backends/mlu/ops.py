"""BANG C for each gOperator kind (moves, elementwise, reduce, broadcast) of one unit.

`OpEmitter` is mixed into `MLUKernel`; every method returns C lines for the unit whose
index is `self.frame.u`, with on-chip buffers named through `self.frame.bufs`. A vector
instruction (`__bang_*`) is used where one exists and its operands are whole 64-byte
aligned NRAM buffers (docs/bang.md: operand alignment 64 B, length padded to 128 B);
anything else is a scalar loop over NRAM (elementwise ones in a `__mlu_func__` helper).
"""
from __future__ import annotations

from dataclasses import dataclass

from powerfusion.backends.source import RenderError
from powerfusion.backends.mlu.slices import (SPACE, Raw, c_index, const_value, direction, flat_start, row_start,
                                             row_stride)
from powerfusion.gir.expr import Const, substitute
from powerfusion.gir.interpreter import np_dtype
from powerfusion.gir.ir import GOp, Level, MemorySlice

VEC_DTYPES = ("float32", "float16")
GRANULE = 128          # bytes: vector lengths are padded to this
STAGE_ELEMS = 4096     # largest staging chunk (elements) of a gather/convert store
# ONNX max/min/Relu/Clip (and numpy, onnxruntime) give NaN where an operand is NaN. What
# __bang_maximum/__bang_minimum/__bang_active_relu, the max/min pools and __bang_argmax/argmin do
# with NaN is not documented (docs/bang.md), and a compare-select drops it, so those functions
# and reductions take the scalar loops with the NaN-propagating pf_fmaxf/pf_fminf instead.
_VEC_BINARY = {"add": "__bang_add", "sub": "__bang_sub", "mul": "__bang_mul"}
_VEC_UNARY = {"exp": "__bang_active_exp", "sigmoid": "__bang_active_sigmoid",
              "reciprocal": "__bang_active_reciphp", "sqrt": "__bang_sqrt", "rsqrt": "__bang_active_rsqrthp",
              "abs": "__bang_abs"}
_POOL = {"sum": "__bang_sumpool"}
_COMBINE = {"sum": "({a} + {b})", "prod": "({a} * {b})", "max": "(({b}) > ({a}) ? ({b}) : ({a}))",
            "min": "(({b}) < ({a}) ? ({b}) : ({a}))"}
_FLOAT_COMBINE = {**_COMBINE, "max": "pf_fmaxf({a}, {b})", "min": "pf_fminf({a}, {b})"}
_INT_IDENTITY = {"sum": "0", "prod": "1", "max": "(-9223372036854775807LL - 1)", "min": "9223372036854775807LL"}
_FLOAT_IDENTITY = {"sum": "0.0f", "prod": "1.0f", "max": "(-__builtin_inff())", "min": "__builtin_inff()"}


@dataclass(frozen=True)
class Frame:
    """Where one unit's code runs: its index variable, the C pointer of each on-chip
    buffer, and whether GDRAM copies may be left in flight (pipelined form)."""
    u: str
    bufs: dict
    async_io: bool = False


class OpEmitter:
    frame: Frame

    # ---- naming and indexing ----------------------------------------------------------
    def base(self, s: MemorySlice) -> str:
        return self.ptr(s.buffer) if s.level == Level.GLOBAL else self.frame.bufs[s.buffer]

    def idx(self, e, i="i", j="j") -> str:
        return c_index(e, self.frame.u, i, j, load=lambda b, ix: f"((int){self.ptr(b)}[{ix}])")

    def at(self, s: MemorySlice, k: str, tag: str) -> tuple[str, str | None]:
        """(address, valid-condition) of element k (row-major) of slice s; defines nothing,
        uses the C variables `<tag>i`, `<tag>j` which `_coords` declares."""
        a = self.idx(s.index, f"{tag}i", f"{tag}j")
        v = None if s.valid is None else self.idx(s.valid, f"{tag}i", f"{tag}j")
        return a, v

    @staticmethod
    def _coords(s: MemorySlice, tag: str) -> str:
        return f"const int {tag}i = k / {s.width}, {tag}j = k % {s.width};"

    def dtype(self, s: MemorySlice) -> str:
        return self.graph.buffer(s.buffer).dtype

    def isz(self, s: MemorySlice) -> int:
        return np_dtype(self.dtype(s)).itemsize

    def vec_whole(self, s: MemorySlice, write: bool) -> bool:
        """A vector operand: an on-chip NRAM slice starting at 0 (aligned) whose padded
        length stays inside the buffer's data (writes may not clobber other elements)."""
        if s.level != Level.REGISTER or s.valid is not None or self.dtype(s) not in VEC_DTYPES:
            return False
        if const_value(flat_start(s)) != 0:
            return False
        g = GRANULE // self.isz(s)
        return not write or s.count % g == 0 or s.count >= self.graph.buffer(s.buffer).size

    def padded(self, s: MemorySlice, granule_bytes: int = GRANULE) -> int:
        g = granule_bytes // self.isz(s)
        return -(-s.count // g) * g

    def memcpy(self, dst: str, src: str, nbytes, d: str, stride=None) -> str:
        fn = "__memcpy_async" if self.frame.async_io and "GDRAM" in d and d != "GDRAM2GDRAM" else "__memcpy"
        if stride:
            ds, ss, segs = stride
            return f"{fn}({dst}, {src}, {nbytes}, {d}, {ds}, {ss}, {segs});"
        return f"{fn}({dst}, {src}, {nbytes}, {d});"

    # ---- move -------------------------------------------------------------------------
    def _move(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        sdt, ddt = self.dtype(src), self.dtype(dst)
        plain = src.valid is None and dst.valid is None
        if plain and sdt == ddt:
            fast = self._copy_fast(src, dst)
            if fast is not None:
                return fast
        if plain and (sdt, ddt) == ("float16", "float32") and src.level == Level.GLOBAL and \
                flat_start(src) is not None and self.vec_whole(dst, True):
            n = self.padded(src, 2 * GRANULE)
            self.need_stage(n * 2)
            return [f"__memcpy(pf_stage, {self.base(src)} + {self.idx(flat_start(src))}, {src.count * 2}, GDRAM2NRAM);",
                    f"__bang_half2float({self.base(dst)}, (half*)pf_stage, {n});"]
        if plain and (sdt, ddt) == ("float32", "float16") and dst.level == Level.GLOBAL and \
                flat_start(dst) is not None and self.vec_whole(src, False):
            n = self.padded(dst, 2 * GRANULE)
            self.need_stage(n * 2)
            return [f"__bang_float2half_rn((half*)pf_stage, {self.base(src)}, {n});",
                    f"__memcpy({self.base(dst)} + {self.idx(flat_start(dst))}, pf_stage, {dst.count * 2}, NRAM2GDRAM);"]
        if dst.level == Level.GLOBAL:
            return self._staged_store(src, dst)
        return self._element_copy(src, dst)

    def _copy_fast(self, src: MemorySlice, dst: MemorySlice) -> list[str] | None:
        """Plain copies as __memcpy: flat to flat, or a flat side against row-contiguous segments
        (the 2-D strided form when the segment stride is constant)."""
        d, isz = direction(src.level, dst.level), self.isz(src)
        fs, fd = flat_start(src), flat_start(dst)
        if fs is not None and fd is not None:
            return [self.memcpy(f"{self.base(dst)} + {self.idx(fd)}", f"{self.base(src)} + {self.idx(fs)}",
                                src.count * isz, d)]
        if fs is not None or fd is not None:
            rows, other, rows_is_src = (src, dst, True) if fd is not None else (dst, src, False)
            rs = row_start(rows)
            if rs is None:
                return None
            flat = self.idx(fd if rows_is_src else fs)
            seg = rows.width * isz
            stride = row_stride(rows)
            r0 = self.idx(substitute(rs, {"i": Const(0)}))
            if stride is not None and stride >= rows.width and rows.num > 1:
                pair = (seg, stride * isz) if rows_is_src else (stride * isz, seg)
                if rows_is_src:
                    return [self.memcpy(f"{self.base(dst)} + {flat}", f"{self.base(src)} + {r0}", seg, d,
                                        pair + (rows.num - 1,))]
                return [self.memcpy(f"{self.base(dst)} + {r0}", f"{self.base(src)} + {flat}", seg, d,
                                    pair + (rows.num - 1,))]
            ri = self.idx(rs)
            if rows_is_src:
                body = self.memcpy(f"{self.base(dst)} + {flat} + i * {rows.width}", f"{self.base(src)} + {ri}", seg, d)
            else:
                body = self.memcpy(f"{self.base(dst)} + {ri}", f"{self.base(src)} + {flat} + i * {rows.width}", seg, d)
            return [f"for (int i = 0; i < {rows.num}; ++i) {body}"]
        rs, rd = row_start(src), row_start(dst)
        if rs is not None and rd is not None and src.num == dst.num and src.width == dst.width:
            return [f"for (int i = 0; i < {src.num}; ++i) "
                    + self.memcpy(f"{self.base(dst)} + {self.idx(rd)}", f"{self.base(src)} + {self.idx(rs)}",
                                  src.width * isz, d)]
        return None

    def _value(self, src: MemorySlice, to: str) -> str:
        """Element k of src converted to dtype `to` (fill where src is not valid)."""
        a, v = self.at(src, "k", "s")
        val = self.r.convert(f"{self.base(src)}[{a}]", self.dtype(src), to)
        if v is not None:
            val = f"(({v}) ? {val} : {self.r.convert(_literal(src.fill, self.dtype(src)), self.dtype(src), to)})"
        return val

    def _element_copy(self, src: MemorySlice, dst: MemorySlice) -> list[str]:
        """Element loop into NRAM/SRAM (reads GDRAM by scalar loads: gathers, masks, conversions)."""
        a, v = self.at(dst, "k", "d")
        store = f"{self.base(dst)}[{a}] = {self._value(src, self.dtype(dst))};"
        return [f"for (int k = 0; k < {src.count}; ++k) {{", f"  {self._coords(src, 's')} {self._coords(dst, 'd')}",
                f"  {'if (' + v + ') ' if v else ''}{store}", "}"]

    def _staged_store(self, src: MemorySlice, dst: MemorySlice) -> list[str]:
        """Any store to GDRAM: elements in order, each maximal run of consecutive destination
        addresses written by one __memcpy (from the source when it is a flat NRAM/SRAM slice of
        the same dtype, else from values staged in NRAM)."""
        ddt, isz = self.dtype(dst), self.isz(dst)
        fs = flat_start(src)
        direct = src.level != Level.GLOBAL and fs is not None and src.valid is None and self.dtype(src) == ddt
        a, v = self.at(dst, "k", "d")
        lines = ["{ int pf_n = 0, pf_a0 = 0, pf_k0 = 0;", f"  for (int k = 0; k < {src.count}; ++k) {{",
                 f"    {self._coords(src, 's')} {self._coords(dst, 'd')}"]
        ctype = self.r.ctype[ddt]
        if direct:
            d, from_ = direction(src.level, Level.GLOBAL), f"{self.base(src)} + {self.idx(fs)} + pf_k0"
        else:
            chunk = min(src.count, STAGE_ELEMS)
            self.need_stage(chunk * isz)
            d, from_ = "NRAM2GDRAM", f"(({ctype}*)pf_stage) + pf_k0 % {chunk}"
        flush = f"__memcpy({self.base(dst)} + pf_a0, {from_}, pf_n * {isz}, {d});"
        if not direct:
            lines += [f"    if (k % {chunk} == 0 && pf_n > 0) {{ {flush} pf_n = 0; }}",
                      f"    (({ctype}*)pf_stage)[k % {chunk}] = {self._value(src, ddt)};"]
        lines += [f"    const bool ok = {v or 'true'}; const int a = {a};",
                  "    if (pf_n > 0 && ok && a == pf_a0 + pf_n) { ++pf_n; continue; }",
                  f"    if (pf_n > 0) {flush}", "    if (ok) { pf_a0 = a; pf_k0 = k; pf_n = 1; } else { pf_n = 0; }",
                  "  }", f"  if (pf_n > 0) {flush}", "}"]
        return lines

    # ---- elementwise ------------------------------------------------------------------
    def _elementwise(self, op: GOp) -> list[str]:
        out, fn = op.outputs[0], op.args.fn
        for s in op.inputs + op.outputs:
            if s.level == Level.GLOBAL or s.count != out.count:
                raise RenderError(f"elementwise operands must be on-chip slices of equal size: {op.describe()}")
        dts = {self.dtype(s) for s in op.inputs + op.outputs}
        vec = len(dts) == 1 and self.vec_whole(out, True) and all(self.vec_whole(s, False) for s in op.inputs)
        if vec:
            lines = self._vector_elementwise(op)
            if lines is not None:
                return lines
        return self._scalar_elementwise(op)

    def _vector_elementwise(self, op: GOp) -> list[str] | None:
        out, fn, ins = op.outputs[0], op.args.fn, op.inputs
        o, n = self.base(out), self.padded(out)
        b = [self.base(s) for s in ins]
        if fn in _VEC_BINARY:
            return [f"{_VEC_BINARY[fn]}({o}, {b[0]}, {b[1]}, {n});"]
        if fn in _VEC_UNARY:
            return [f"{_VEC_UNARY[fn]}({o}, {b[0]}, {n});"]
        if fn == "neg":
            return [f"__bang_mul_scalar({o}, {b[0]}, ({self.r.ctype[self.dtype(out)]})-1.0f, {n});"]
        if fn == "identity":
            return [f"__memcpy({o}, {b[0]}, {out.count * self.isz(out)}, NRAM2NRAM);"] if o != b[0] else []
        if fn == "div":  # a / b = a * (1 / b); the reciprocal goes to the scratch area
            self.need_tmp(n * self.isz(out))
            t = f"(({self.r.ctype[self.dtype(out)]}*)pf_tmp)"
            return [f"__bang_active_reciphp({t}, {b[1]}, {n});", f"__bang_mul({o}, {b[0]}, {t}, {n});"]
        return None

    def _scalar_elementwise(self, op: GOp) -> list[str]:
        out, fn = op.outputs[0], op.args.fn
        odt = self.dtype(out)
        wide = lambda s, x: self.r.convert(x, "float16", "float32") if self.dtype(s) == "float16" else x
        starts = [flat_start(s) for s in op.inputs + op.outputs]
        if all(st is not None for st in starts) and all(s.valid is None for s in op.inputs + op.outputs):
            # flat operands: one __mlu_func__ helper per (function, dtypes), called with pointers
            args = [f"a{n}[k]" for n in range(len(op.inputs))]
            val = self.r.scalar(fn, dict(op.args.params), [wide(s, a) for s, a in zip(op.inputs, args)], odt)
            if odt == "float16":
                val = self.r.convert(val, "float32", "float16")
            params = [f"{self.r.ctype[odt]}* out"] + [f"const {self.r.ctype[self.dtype(s)]}* a{n}"
                                                     for n, s in enumerate(op.inputs)]
            helper = self.helper(params, [f"for (int k = 0; k < n; ++k) out[k] = {val};"])
            ptrs = [f"{self.base(s)} + {self.idx(st)}" for s, st in zip(op.inputs + op.outputs, starts)]
            return [f"{helper}({', '.join([ptrs[-1], *ptrs[:-1]])}, {out.count});"]
        operands = []
        for n, s in enumerate(op.inputs):
            a, _ = self.at(s, "k", f"x{n}")
            operands.append(wide(s, f"{self.base(s)}[{a}]"))
        val = self.r.scalar(fn, dict(op.args.params), operands, odt)
        if odt == "float16":
            val = self.r.convert(val, "float32", "float16")
        a, _ = self.at(out, "k", "o")
        coords = " ".join([self._coords(s, f"x{n}") for n, s in enumerate(op.inputs)] + [self._coords(out, "o")])
        return [f"for (int k = 0; k < {out.count}; ++k) {{", f"  {coords}", f"  {self.base(out)}[{a}] = {val};", "}"]

    # ---- reduce -----------------------------------------------------------------------
    def _reduce(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        fn, over = op.args.fn, op.args.over
        if fn == "sumexp":
            raise RenderError("reduce(sumexp) (the one-pass softmax form) has no BANG C rendering yet")
        dt = self.dtype(src)
        g = GRANULE // self.isz(src) if dt in VEC_DTYPES else 0
        if g and dt == self.dtype(dst) and fn in _POOL and self.vec_whole(src, False) and src.width % g == 0:
            s, d = self.base(src), self.base(dst)
            if over == "num" and self.vec_whole(dst, True):
                # HWC pooling with C = width, W = num: dst[c] = reduce over w of src[w * C + c]
                return [f"{_POOL[fn]}({d}, {s}, {src.width}, 1, {src.num}, 1, {src.num}, 1, 1);"]
            if over == "width":
                # per row: pool the row down to one 128-byte group, then reduce that group
                w = src.width // g
                self.need_tmp(2 * GRANULE)
                t = f"(({self.r.ctype[dt]}*)pf_tmp)"
                a, _ = self.at(dst, "k", "d")
                return [f"for (int k = 0; k < {src.num}; ++k) {{", f"  {self._coords(dst, 'd')}",
                        f"  {_POOL[fn]}({t}, {s} + k * {src.width}, {g}, 1, {w}, 1, {w}, 1, 1);",
                        f"  __bang_reduce_sum({t} + {g}, {t}, {g});", f"  {d}[{a}] = {t}[{g}];", "}"]
        return self._scalar_reduce(op)

    def _scalar_reduce(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        fn, over = op.args.fn, op.args.over
        sdt, ddt = self.dtype(src), self.dtype(dst)
        is_float = np_dtype(sdt).kind == "f"
        acc_t = "float" if is_float else "long long"
        ident = (_FLOAT_IDENTITY if is_float else _INT_IDENTITY)[fn]
        outer, inner = (src.num, src.width) if over == "width" else (src.width, src.num)
        si, sj = ("o", "n") if over == "width" else ("n", "o")
        a = self.idx(src.index, si, sj)
        val = self.r.convert(f"{self.base(src)}[{a}]", sdt, "float32") if sdt == "float16" else f"{self.base(src)}[{a}]"
        upd = f"acc = {(_FLOAT_COMBINE if is_float else _COMBINE)[fn].format(a='acc', b=val)};"
        if src.valid is not None:
            upd = f"if ({self.idx(src.valid, si, sj)}) {upd}"
        da = self.idx(dst.index, "k / " + str(dst.width), "k % " + str(dst.width)) if dst.width > 1 or dst.num > 1 \
            else self.idx(dst.index, "0", "0")
        res = self.r.convert("acc", "float32", ddt) if is_float else f"({self.r.ctype[ddt]})acc"
        return [f"for (int o = 0; o < {outer}; ++o) {{", f"  {acc_t} acc = {ident};",
                f"  for (int n = 0; n < {inner}; ++n) {upd}", "  const int k = o;", f"  {self.base(dst)}[{da}] = {res};",
                "}"]

    # ---- broadcast --------------------------------------------------------------------
    def _broadcast(self, op: GOp) -> list[str]:
        (src,), (dst,) = op.inputs, op.outputs
        over = op.args.over
        sdt, ddt = self.dtype(src), self.dtype(dst)
        fs, fd = flat_start(src), flat_start(dst)
        if sdt == ddt and fs is not None and fd is not None and dst.level == src.level == Level.REGISTER:
            if over == "num" and dst.width * self.isz(dst) >= 64:
                seg = dst.width * self.isz(dst)
                return [f"for (int i = 0; i < {dst.num}; ++i) __memcpy({self.base(dst)} + {self.idx(fd)} + i * "
                        f"{dst.width}, {self.base(src)} + {self.idx(fs)}, {seg}, NRAM2NRAM);"]
            if sdt in VEC_DTYPES and (dst.width * self.isz(dst)) % GRANULE == 0 and const_value(fd) == 0:
                return [f"for (int i = 0; i < {dst.num}; ++i) __bang_write_value({self.base(dst)} + i * {dst.width}, "
                        f"{dst.width}, {self.base(src)}[{self.idx(fs)} + i]);"]
        a, _ = self.at(dst, "k", "d")
        srcpos = "(k / " + str(dst.width) + ")" if over == "width" else "(k % " + str(dst.width) + ")"
        sa = self.idx(substitute(src.index, {"i": Raw(srcpos if over == "width" else "0"),
                                             "j": Raw("0" if over == "width" else srcpos)}))
        val = self.r.convert(f"{self.base(src)}[{sa}]", sdt, ddt)
        return [f"for (int k = 0; k < {dst.count}; ++k) {{", f"  {self._coords(dst, 'd')}",
                f"  {self.base(dst)}[{a}] = {val};", "}"]


def _literal(x: float, dtype: str) -> str:
    from powerfusion.backends.mlu.slices import c_float
    if dtype == "bool":
        return "true" if x else "false"
    if np_dtype(dtype).kind in "iu":
        return str(int(x))
    return c_float(x)


__all__ = ["OpEmitter", "Frame", "SPACE"]
