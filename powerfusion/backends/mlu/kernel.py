"""One BANG C kernel from one kernel's gOperators (the part of a GIR graph between DEVICE syncs).

Three forms, chosen per kernel:

* shared (the kernel uses SHARED buffers or BLOCK syncs): CNRT_FUNC_TYPE_UNION1; each cluster
  takes GIR groups in turn, its 4 cores take the group's units, phases between BLOCK syncs
  end in `__sync_cluster()`;
* pipelined (the default otherwise, when legal and NRAM allows two copies of every buffer):
  CNRT_FUNC_TYPE_UNION1, but no use of the cluster; each task walks its units with the loads of unit k+1 in flight
  (`__memcpy_async`) while unit k computes, its stores asynchronous too, one `__sync_io()`
  per unit;
* plain: like pipelined, with synchronous copies.
"""
from __future__ import annotations

from powerfusion.names import UniqueNames

from powerfusion.backends.source import op_line_ranges
from powerfusion.backends.source import KernelSource, RenderError
from powerfusion.backends.mlu.ops import Frame, OpEmitter
from powerfusion.gir.expr import BinOp, Const, U, loads
from powerfusion.gir.interpreter import np_dtype
from powerfusion.gir.ir import Broadcast, Elementwise, GIRGraph, GOp, Level, Move, Reduce, Scope, Sync

ALIGN = 256  # on-chip buffers start 64-byte aligned and hold whole 128-byte vector granules


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class MLUKernel(OpEmitter):
    def __init__(self, renderer, graph: GIRGraph, ops: tuple[GOp, ...], name: str):
        from powerfusion.names import sanitize
        self.r, self.graph, self.ops, self.name = renderer, graph, ops, name
        self.sanitize = sanitize
        self.P = graph.parallel
        self._names = UniqueNames()
        self.helpers: list[str] = []
        self.stage_bytes = self.tmp_bytes = 0
        self.shared_mode = any(isinstance(op.args, Sync) and op.args.scope == Scope.BLOCK for op in ops) or \
            any(s.level == Level.SHARED for op in ops for s in op.inputs + op.outputs)
        self.onchip = self._onchip_buffers()
        for b in self.onchip + [s.buffer for op in ops for s in op.inputs + op.outputs]:
            if self.graph.buffer(b).dtype not in renderer.ctype:
                raise RenderError(f"kernel {name}: buffer '{b}' has dtype {self.graph.buffer(b).dtype}, which the "
                                  f"MLU backend does not emit (supported: {', '.join(renderer.ctype)})")
        self.pipelined = bool(renderer.pipeline) and not self.shared_mode and self._can_pipeline()
        self.units = self._unit_bound()

    # ---- analysis ---------------------------------------------------------------------
    def _onchip_buffers(self) -> list[str]:
        seen = []
        for op in self.ops:
            for s in op.inputs + op.outputs:
                if s.level != Level.GLOBAL and s.buffer not in seen:
                    seen.append(s.buffer)
        return seen

    def _unit_bound(self) -> int:
        """Units the kernel can touch: a graph's kernels share its Parallel, but when every op
        is guarded by `u < N` the units past the largest N have nothing to do."""
        bound = 0
        for op in self.ops:
            if isinstance(op.args, Sync):
                continue
            g = op.guard
            if isinstance(g, BinOp) and g.op == "lt" and g.a == U and isinstance(g.b, Const):
                bound = max(bound, g.b.value)
            else:
                return self.P.units
        return min(bound, self.P.units) or self.P.units

    @staticmethod
    def is_load(op: GOp) -> bool:
        return isinstance(op.args, Move) and op.inputs[0].level == Level.GLOBAL and op.outputs[0].level != Level.GLOBAL

    def _can_pipeline(self) -> bool:
        """Loads may be hoisted ahead of the unit's other ops (no earlier op touches their
        destination; nothing in the kernel writes what they read) and the stores' NRAM sources
        are not overwritten later in the unit (they stay in flight until the next unit)."""
        written_global = {s.buffer for op in self.ops for s in op.outputs if s.level == Level.GLOBAL}
        if not any(self.is_load(op) for op in self.ops):
            return False
        touched: set[str] = set()
        for k, op in enumerate(self.ops):
            if self.is_load(op):
                src = op.inputs[0]
                read = {src.buffer} | loads(src.index) | (loads(src.valid) if src.valid is not None else frozenset())
                if read & written_global or op.outputs[0].buffer in touched:
                    return False
                if op.guard is not None and loads(op.guard) & written_global:
                    return False
                continue
            touched.update(s.buffer for s in op.inputs + op.outputs)
            if isinstance(op.args, Move) and op.outputs[0].level == Level.GLOBAL:
                later = {s.buffer for o in self.ops[k + 1:] if not self.is_load(o) for s in o.outputs}
                if op.inputs[0].buffer in later:
                    return False
        return True

    # ---- names and scratch ------------------------------------------------------------
    def ident(self, prefix: str, buf: str) -> str:
        return self._names.ident(prefix, buf)

    def ptr(self, buf: str) -> str:
        return self.ident("p", buf)

    def need_stage(self, nbytes: int) -> None:
        self.stage_bytes = max(self.stage_bytes, nbytes)

    def need_tmp(self, nbytes: int) -> None:
        self.tmp_bytes = max(self.tmp_bytes, nbytes)

    def helper(self, params: list[str], body: list[str]) -> str:
        """A `__mlu_func__` scalar loop; identical helpers of one kernel are emitted once."""
        text = "\n".join(body)
        for k, h in enumerate(self.helpers):
            if h.endswith(f"({', '.join(params)}, int n) {{\n  {text}\n}}"):
                return f"{self.name}_f{k}"
        name = f"{self.name}_f{len(self.helpers)}"
        self.helpers.append(f"__mlu_func__ void {name}({', '.join(params)}, int n) {{\n  {text}\n}}")
        return name

    # ---- code -------------------------------------------------------------------------
    def _op_lines(self, op: GOp, guarded: bool = True) -> list[str]:
        if isinstance(op.args, Sync):
            if op.args.scope == Scope.BLOCK:
                raise RenderError("internal: BLOCK syncs are phase boundaries")
            return []  # LANE / WARP: one lane per unit, nothing to wait for
        lines = {Move: self._move, Elementwise: self._elementwise, Reduce: self._reduce,
                 Broadcast: self._broadcast}[type(op.args)](op)
        if not lines:
            return []
        cond = [self.idx(op.guard)] if op.guard is not None else []
        if self.shared_mode:
            cond.insert(0, "unit_live")
        head = f"// gop {op.uid}: {self._describe(op)}"
        if not cond:
            return [head, *lines]
        return [head, f"if ({' && '.join(cond)}) {{", *["  " + x for x in lines], "}"]

    def _describe(self, op: GOp) -> str:
        """op.describe() with buffer names sanitised (model names never reach the source raw)."""
        sl = lambda xs: ", ".join(f"{self.sanitize(x.buffer)}@{x.level.label} {x.num}x{x.width}" for x in xs)
        head = op.describe().split(" [", 1)[0]
        return f"{head} [{sl(op.inputs)}] -> [{sl(op.outputs)}]"

    def _bufs(self, prefix: str) -> dict[str, str]:
        return {b: self.ident(prefix, b) for b in self.onchip}

    def _body_plain(self) -> list[str]:
        self.frame = Frame("u", self._bufs("r"))
        body = [x for op in self.ops for x in self._op_lines(op)]
        return [f"for (int u = taskId; u < {self.units}; u += taskDim) {{", *["  " + x for x in body], "}"]

    def _body_pipelined(self) -> list[str]:
        loads_ = [op for op in self.ops if self.is_load(op)]
        rest = [op for op in self.ops if not self.is_load(op)]
        cur, nxt = self._bufs("r"), self._bufs("n")
        loaded = {op.outputs[0].buffer for op in loads_}
        c0, c1 = self._bufs("b0"), self._bufs("b1")
        self.frame = Frame("u_next", c0, True)
        prologue = [x for op in loads_ for x in self._op_lines(op)]
        self.frame = Frame("u_next", nxt, True)
        prefetch = [x for op in loads_ for x in self._op_lines(op)]
        self.frame = Frame("u", cur, True)
        compute, stored, computed = [], set(), False
        for op in rest:
            if isinstance(op.args, Move) and op.outputs[0].level == Level.GLOBAL:
                if computed:
                    compute.append("__sync_compute();  // results in NRAM before the IO pipe reads them")
                    computed = False
                if op.outputs[0].buffer in stored:
                    compute.append("__sync_io();  // a second store to the same buffer: let the first land")
                stored.add(op.outputs[0].buffer)
            elif not isinstance(op.args, Sync):
                computed = True
            compute += self._op_lines(op)
        ctype = {b: self.r.ctype[self.graph.buffer(b).dtype] for b in self.onchip}
        n = self.units
        return [f"const int pf_iters = taskId < {n} ? ({n} - 1 - taskId) / taskDim + 1 : 0;",
                "if (pf_iters > 0) {  // prologue: the first unit's loads into buffer set 0",
                "  const int u_next = taskId;", *["  " + x for x in prologue], "}",
                "for (int pf_k = 0; pf_k < pf_iters; ++pf_k) {", "  const int u = taskId + pf_k * taskDim;",
                *[f"  {ctype[b]}* {cur[b]} = (pf_k & 1) ? {c1[b]} : {c0[b]};" for b in self.onchip],
                "  __sync_io();  // this unit's loads and the previous unit's stores have landed",
                "  if (pf_k + 1 < pf_iters) {  // stage 1: issue the next unit's loads into the other set",
                "    const int u_next = u + taskDim;",
                *[f"    {ctype[b]}* {nxt[b]} = (pf_k & 1) ? {c0[b]} : {c1[b]};" for b in self.onchip
                  if b in loaded],
                *["    " + x for x in prefetch], "  }",
                "  // stage 2: compute this unit; its stores stay in flight until the next __sync_io",
                *["  " + x for x in compute], "}", "__sync_io();"]

    def _phases(self) -> list[list[GOp]]:
        parts, cur = [], []
        for op in self.ops:
            if isinstance(op.args, Sync) and op.args.scope == Scope.BLOCK:
                parts.append(cur)
                cur = []
            else:
                cur.append(op)
        return parts + [cur]

    def _body_shared(self) -> tuple[list[str], dict[str, int]]:
        """Clusters take GIR groups; the group's units are spread over the 4 cores; a REGISTER
        buffer used in two phases gets one copy per unit a core holds."""
        upg, cores = self.P.units_per_group, self.r.cores_per_cluster
        per_core = -(-upg // cores)
        phases = self._phases()
        used_in = {b: sum(1 for ph in phases if any(s.buffer == b for op in ph for s in op.inputs + op.outputs))
                   for b in self.onchip}
        slots = {b: per_core if used_in[b] > 1 and self.graph.buffer(b).level == Level.REGISTER else 1
                 for b in self.onchip}
        base = self._bufs("r")
        body = [f"for (int pf_g = taskId / {cores}; pf_g < {self.P.groups}; pf_g += taskDim / {cores}) {{"]
        for n, ph in enumerate(phases):
            local = {b: (self.ident("l", b) if slots[b] > 1 else base[b]) for b in self.onchip}
            self.frame = Frame("u", local)
            lines = [x for op in ph for x in self._op_lines(op)]
            decl = [f"  {self.r.ctype[self.graph.buffer(b).dtype]}* {local[b]} = {base[b]} + (pf_l / {cores}) * "
                    f"{self._elems(b)};" for b in self.onchip if slots[b] > 1]
            body += [f"  for (int pf_l = taskId % {cores}; pf_l < {upg}; pf_l += {cores}) {{",
                     f"    const int u = pf_g * {upg} + pf_l; const bool unit_live = u < {self.P.units};",
                     *["  " + d for d in decl], *["    " + x for x in lines], "  }",
                     "  __sync_cluster();" + ("  // the group's data is reused by the next group" if n == len(phases) - 1
                                              else "")]
        return body + ["}"], slots

    def _elems(self, b: str) -> int:
        buf = self.graph.buffer(b)
        return _up(buf.size * np_dtype(buf.dtype).itemsize) // np_dtype(buf.dtype).itemsize

    def _layout(self, copies: dict[str, int]) -> tuple[list[str], int, int]:
        """Declarations carving the NRAM / SRAM arenas; returns (lines, nram bytes, sram bytes)."""
        decls, nram, sram = [], 0, 0
        names = [("b0", "b1")] if self.pipelined else [("r",)]
        for b in self.onchip:
            buf = self.graph.buffer(b)
            ct = self.r.ctype[buf.dtype]
            nbytes = _up(buf.size * np_dtype(buf.dtype).itemsize) * copies[b]
            for prefix in names[0]:
                if buf.level == Level.SHARED:
                    decls.append(f"{ct}* {self.ident(prefix, b)} = ({ct}*)(pf_sram + {sram});")
                    sram += nbytes
                else:
                    decls.append(f"{ct}* {self.ident(prefix, b)} = ({ct}*)(pf_nram + {nram});")
                    nram += nbytes
        if self.stage_bytes:
            decls.append(f"char* pf_stage = pf_nram + {nram};")
            nram += _up(self.stage_bytes)
        if self.tmp_bytes:
            decls.append(f"char* pf_tmp = pf_nram + {nram};")
            nram += _up(self.tmp_bytes)
        return decls, nram, sram

    def render(self) -> KernelSource:
        copies = {b: 1 for b in self.onchip}
        if self.shared_mode:
            body, copies = self._body_shared()
        elif self.pipelined:
            body = self._body_pipelined()
        else:
            body = self._body_plain()
        decls, nram, sram = self._layout(copies)
        if self.pipelined and nram > self.r.nram_bytes:
            self.pipelined = False  # two buffer sets do not fit: the synchronous form
            self.helpers, self.stage_bytes, self.tmp_bytes = [], 0, 0
            return self.render()
        if nram > self.r.nram_bytes or sram > self.r.sram_bytes:
            raise RenderError(f"kernel {self.name}: on-chip buffers need {nram} B of NRAM and {sram} B of SRAM; "
                              f"MLU370 has {self.r.nram_bytes} B and {self.r.sram_bytes} B (the GIR tiles are too big)")
        params, plist = self._params()
        tasks, ftype = self._launch()
        src = _SOURCE.format(
            graph=self.sanitize(self.graph.name), name=self.name, nram=max(nram, 64), sram=max(sram, 64),
            form="shared (UNION1)" if self.shared_mode else "pipelined" if self.pipelined else "plain",
            sram_arena=_SRAM_ARENA.format(sram=max(sram, 64)) if sram else "",
            helpers="\n".join(self.helpers) + ("\n" if self.helpers else ""),
            params=", ".join(params), decls="\n".join("  " + d for d in decls),
            body="\n".join("  " + x for x in body), nram_need=nram, sram_need=sram,
            sram_check=f'  static_assert({sram} <= PF_SRAM_BYTES, "SRAM arena too small for {self.name}");\n'
            if sram else "",
            args=", ".join(self.ptr(b) for b, _, _ in plist), tasks=tasks, ftype=ftype)
        return KernelSource(self.name, src, (tasks, 1, 1), (1, 1, 1), sram, tuple(plist), op_line_ranges(src))

    def _params(self):
        used, written = [], set()
        for op in self.ops:
            for s in op.inputs + op.outputs:
                extra = loads(s.index) | (loads(s.valid) if s.valid is not None else frozenset())
                for b in ([s.buffer] if s.level == Level.GLOBAL else []) + sorted(extra):
                    if b not in used:
                        used.append(b)
                if s in op.outputs and s.level == Level.GLOBAL:
                    written.add(s.buffer)
            if op.guard is not None:
                used += [b for b in sorted(loads(op.guard)) if b not in used]
        params, plist = [], []
        for b in used:
            buf = self.graph.buffer(b)
            const = "" if b in written else "const "
            params.append(f"{const}{self.r.ctype[buf.dtype]}* {self.ptr(b)}")
            plist.append((b, buf.dtype, b in written))
        return params, plist

    def _launch(self) -> tuple[int, str]:
        """UNION1 everywhere (whole clusters, as mlu-ops launches most kernels): the shared form
        needs it, and the others then run in a program that also holds SRAM."""
        cores = self.r.cores_per_cluster
        if self.shared_mode:
            return cores * min(self.P.groups, self.r.clusters), "CNRT_FUNC_TYPE_UNION1"
        return cores * min(-(-self.units // cores), self.r.clusters), "CNRT_FUNC_TYPE_UNION1"


_SRAM_ARENA = """#ifndef PF_SRAM_BYTES
#define PF_SRAM_BYTES {sram}
#endif
#ifndef PF_SRAM_ARENA
#define PF_SRAM_ARENA
__mlu_shared__ char pf_sram[PF_SRAM_BYTES] __attribute__((aligned(64)));
#endif
"""

_SOURCE = """// {name}: kernel of memory-bound subgraph {graph}, BANG C for MLU370 ({form}).
// Generated by PowerFusion. Launch with launch_{name}(queue, ...) below.
#include <bang.h>
#include <cnrt.h>

#ifndef PF_LAUNCH
#define PF_LAUNCH(k, dim, type, queue, ...) k<<<dim, type, queue>>>(__VA_ARGS__)
#endif
// One NRAM arena per core, carved by each kernel; a build holding several kernels defines
// PF_NRAM_BYTES as the largest need first.
#ifndef PF_NRAM_BYTES
#define PF_NRAM_BYTES {nram}
#endif
#ifndef PF_NRAM_ARENA
#define PF_NRAM_ARENA
__nram__ char pf_nram[PF_NRAM_BYTES] __attribute__((aligned(64)));
#endif
{sram_arena}#ifndef PF_INDEX_HELPERS
#define PF_INDEX_HELPERS
__mlu_func__ int pf_imin(int a, int b) {{ return a < b ? a : b; }}
__mlu_func__ int pf_imax(int a, int b) {{ return a > b ? a : b; }}
__mlu_func__ int pf_ifloormod(int a, int b) {{ int r = a % b; return (r != 0 && (r < 0) != (b < 0)) ? r + b : r; }}
__mlu_func__ int pf_ifloordiv(int a, int b) {{ return (a - pf_ifloormod(a, b)) / b; }}
#endif
#ifndef PF_NAN_OPS
#define PF_NAN_OPS
// ONNX max/min/Relu/Clip propagate NaN; fmaxf/fminf and compare-selects drop it
__mlu_func__ float pf_fmaxf(float a, float b) {{ return (a != a || b != b) ? a + b : (a > b ? a : b); }}
__mlu_func__ float pf_fminf(float a, float b) {{ return (a != a || b != b) ? a + b : (a < b ? a : b); }}
__mlu_func__ float pf_floor_modf(float a, float b) {{ const float r = fmodf(a, b); return r != 0.0f ? (((r < 0.0f) != (b < 0.0f)) ? r + b : r) : (b < 0.0f ? -0.0f : 0.0f); }}
#endif
{helpers}
__mlu_entry__ void {name}({params}) {{
  static_assert({nram_need} <= PF_NRAM_BYTES, "NRAM arena too small for {name}");
{sram_check}{decls}
{body}
}}

void launch_{name}(cnrtQueue_t queue, {params}) {{
  cnrtDim3_t dim = {{{tasks}, 1, 1}};
  PF_LAUNCH({name}, dim, {ftype}, queue, {args});
}}
"""
