"""CPU: the shared C-style renderer as plain C with OpenMP.

Mapping (the GPU one of backends/cstyle/renderer.py, folded onto cores): the CPU target plans one
lane per unit and one unit per group, so a parallel unit is one iteration of an OpenMP loop
(`#pragma omp parallel for`), a unit's register tile and its group's shared tile are locals
of that iteration (thread-local scratch), WARP and BLOCK syncs order nothing that program
order does not already order, and a DEVICE sync is a kernel boundary (one OpenMP loop per
kernel). The inner per-element loops are left to the compiler's vectoriser (`restrict`
pointers, `-O3 -march=native`). fp16 is `_Float16`; bf16 is kept as its bit pattern
(uint16_t) and converted with round-to-nearest-even, as numpy's ml_dtypes does.
"""
from __future__ import annotations

from powerfusion.backends.cstyle.kernel import KernelRenderer, RegLayout, _identity_layout
from powerfusion.backends.cstyle.renderer import CRenderer
from powerfusion.backends.source import KernelSource, RenderError
from powerfusion.gir.ir import GIRGraph, Level
from powerfusion.names import sanitize

# a kernel that touches fewer elements than this runs on one thread (fork-join costs microseconds)
PARALLEL_MIN_ELEMENTS = 1 << 16

_HELPERS = r"""#include <math.h>
#include <stdint.h>
#include <stdbool.h>
#include <string.h>
#ifndef PF_KERNEL
#define PF_KERNEL
#endif
#ifndef PF_CPU_HELPERS
#define PF_CPU_HELPERS
typedef uint16_t pf_bf16;
static inline float pf_bf16_to_f(pf_bf16 x) { uint32_t b = (uint32_t)x << 16; float f; memcpy(&f, &b, 4); return f; }
static inline pf_bf16 pf_f_to_bf16(float f) {
  uint32_t b; memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (pf_bf16)((b >> 16) | 0x40u);   /* NaN stays NaN */
  return (pf_bf16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static inline float pf_int_as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
#define __int_as_float(x) pf_int_as_float(x)
/* index arithmetic's min/max (CUDA has them built in) */
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
/* ONNX max/min/Relu/Clip propagate NaN (C's fmaxf/fminf drop it); Python-style float Mod */
static inline float pf_fmaxf(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
static inline float pf_fminf(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
static inline float pf_floor_modf(float a, float b) { float r = fmodf(a, b); return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r; }
/* floored division and modulo (GIR semantics); divisors are positive constants */
static inline long long pf_floordiv(long long a, long long b) { long long q = a / b; return q - ((a % b) < 0); }
static inline long long pf_mod(long long a, long long b) { long long r = a % b; return r + (r < 0 ? b : 0); }
#endif"""


class CPURenderer(CRenderer):
    lanes = 1
    extension = ".c"
    kernel_prefix = "PF_KERNEL"   # external in a plan's .c files; static inside a module
    header = _HELPERS
    barrier = "/* block barrier: program order */ (void)0"
    warp_sync = "(void)0"
    shared = ""
    restrict = "restrict"
    launch_bounds = ""
    skeleton_package = "powerfusion.backends.cpu"
    skeleton = "kernel.j2"
    ctype = {**CRenderer.ctype, "float16": "_Float16", "bfloat16": "pf_bf16", "int16": "int16_t",
             "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t", "int64": "long long"}
    to_float = {"float16": "((float)({}))", "bfloat16": "pf_bf16_to_f({})"}
    from_float = {"float16": "((_Float16)({}))", "bfloat16": "pf_f_to_bf16({})"}
    vector_type: dict = {}   # no hand-written vector moves: the compiler vectorises the element loops

    def ptr_cast(self, ctype: str, value: str) -> str:
        return f"(({ctype}*)({value}))"

    def shfl_xor(self, value: str, mask: int) -> str:
        raise RenderError("a lane exchange on the CPU target (one lane per unit)")

    def scalar(self, fn: str, params: dict, operands: list[str], out_dtype: str) -> str:
        # C integer division by zero traps (SIGFPE ends the process); the GIR executor refuses a
        # zero divisor with a DataError, as onnxruntime does, so such a subgraph stays there
        if fn in ("div", "rem", "mod") and not out_dtype.startswith(("float", "bfloat")):
            raise RenderError(f"integer {fn} ({out_dtype}) runs on the GIR executor, which checks the divisor")
        if fn == "floor_mod":
            return f"pf_floor_modf({operands[0]}, {operands[1]})"
        text = super().scalar(fn, params, operands, out_dtype)
        return text.replace("fmaxf(", "pf_fmaxf(").replace("fminf(", "pf_fminf(")

    def render(self, graph: GIRGraph) -> list[KernelSource]:
        if graph.parallel.units_per_group != 1 or graph.parallel.lanes != 1:
            raise RenderError(f"GIR graph {graph.name} was planned for {graph.parallel.units_per_group} unit(s) "
                              f"of {graph.parallel.lanes} lane(s) per group; the CPU target runs one unit of one lane")
        return [CPUKernelRenderer(self, graph, ops, f"{sanitize(graph.name)}_k{k}").render()
                for k, ops in enumerate(graph.kernels())]


class _FlatTile(RegLayout):
    """A register tile of one lane: element (i, j) of any identity-layout slice is slot
    i * width + j, so every tile has the same layout whatever its slices' widths (equal
    layouts are what the shared kernel renderer checks); `slots` only sizes the declaration."""

    def __eq__(self, other):
        return isinstance(other, RegLayout) and not other.replicated and other.vec == 1

    def __hash__(self):
        return 1


class CPUKernelRenderer(KernelRenderer):
    def _register_layouts(self) -> dict[str, RegLayout]:
        out = {}
        for op in self.ops:
            for s in op.inputs + op.outputs:
                if s.level == Level.REGISTER:
                    if not _identity_layout(s):
                        raise RenderError(f"register slice {s.describe()} of '{op.describe()}' is not in identity layout")
                    out[s.buffer] = _FlatTile(1, 1, False, self.graph.buffer(s.buffer).size)
        return out


def render_module(graph: GIRGraph, renderer: CPURenderer | None = None) -> tuple[str, list[KernelSource]]:
    """One C translation unit for a whole GIR graph: its kernels and `pf_run(void **buffers)`,
    which calls them in order; buffers are passed in the order of `module_buffers(kernels)`."""
    kernels = (renderer or CPURenderer()).render(graph)
    order = module_buffers(kernels)
    parts = []
    for ks, ops in zip(kernels, graph.kernels()):
        work = graph.parallel.units * sum(s.num * s.width for op in ops for s in op.inputs + op.outputs)
        parts.append(f"#define PF_PARALLEL_{ks.name} {int(work >= PARALLEL_MIN_ELEMENTS)}\n{ks.source}")
    calls = []
    for ks in kernels:
        args = [f"({_param_type(ks, name)})b[{order.index(name)}]" for name, _, _ in ks.params]
        calls.append(f"  {ks.name}({', '.join(args)});")
    entry = f"void pf_run_{sanitize(graph.name)}(void **b)\n{{\n" + "\n".join(calls) + "\n}\n"
    return "#define PF_KERNEL static\n" + "\n".join(parts) + "\n" + entry, kernels


def module_buffers(kernels: list[KernelSource]) -> list[str]:
    """The GIR buffers a module's entry point takes, in order (first use)."""
    return list(dict.fromkeys(name for ks in kernels for name, _, _ in ks.params))


def _param_type(ks: KernelSource, name: str) -> str:
    dtype, written = next((d, w) for n, d, w in ks.params if n == name)
    return f"{'' if written else 'const '}{CPURenderer.ctype[dtype]}*"
