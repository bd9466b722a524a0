"""CPU: the shared C-style renderer as plain C with OpenMP.

Mapping (the GPU one of backends/cstyle/renderer.py, folded onto cores): the CPU target plans one
lane per unit and one unit per group, so a parallel unit is one iteration of an OpenMP loop
(`#pragma omp parallel for`), a unit's register tile and its group's shared tile are locals
of that iteration (thread-local scratch), WARP and BLOCK syncs order nothing that program
order does not already order, and a DEVICE sync is a kernel boundary (one OpenMP loop per
kernel). The inner per-element loops are left to the compiler's vectoriser (`restrict`
pointers, `-O3 -march=native`). fp16 is `_Float16`; bf16 is kept as its bit pattern
(uint16_t) and converted with round-to-nearest-even, as numpy's ml_dtypes does; float4 e2m1
(Cast only) is its code in a byte, converted as ml_dtypes' float4_e2m1fn is.
float32 exp, tanh and erf (and sigmoid, through exp) are the header's inline, branch-free
forms, not libm's: libm's are scalar calls of 10-25 ns an element, most of a GELU's or a
softmax's time; the inline forms vectorise and were measured within 1.1 ulp (exp, normal
results), 1.4e-7 (tanh) and 1.8e-7 (erf) relative to float64 on 4M points, NaN and
infinities kept.
"""
from __future__ import annotations

import re

from powerfusion.backends.cstyle.kernel import KernelRenderer, RegLayout, _identity_layout
from powerfusion.backends.cstyle.renderer import CRenderer
from powerfusion.backends.source import KernelSource, RenderError
from powerfusion.gir.ir import GIRGraph, GOp, Level, MemorySlice
from powerfusion.names import sanitize

# libm calls replaced by the header's inline float32 forms (whole words only: not pf_expf itself)
_INLINE_MATH = re.compile(r"\b(expf|tanhf|erff)\(")
_NAMES_IJ = re.compile(r"\b[ij]\b")
FLAT_MIN_SLOTS = 32   # register tiles at least this large loop flat over their slots (_lane_loop)

# a kernel that touches fewer elements than this runs on one thread (fork-join costs microseconds)
PARALLEL_MIN_ELEMENTS = 1 << 20

C_HELPERS = r"""#include <math.h>
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
/* float4 e2m1 (ONNX FLOAT4E2M1, ml_dtypes float4_e2m1fn), one code per byte as numpy stores it:
   sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. To float4:
   round to nearest, ties to the even code, larger magnitudes (and infinities) saturate to 6;
   NaN (no such code) becomes the zero of the opposite sign, as ml_dtypes (the interpreter) does. */
static inline float pf_e2m1_to_f(uint8_t c) {
  static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float m = mag[c & 7u];
  return (c & 8u) ? -m : m;
}
static inline uint8_t pf_f_to_e2m1(float f) {
  uint32_t b; memcpy(&b, &f, 4);
  uint8_t sign = (uint8_t)((b >> 28) & 8u);
  if (f != f) return (uint8_t)(sign ^ 8u);
  float a = fabsf(f);
  uint8_t code = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
               : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
  return (uint8_t)(sign | code);
}
static inline float pf_int_as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
#define __int_as_float(x) pf_int_as_float(x)
/* index arithmetic's min/max (CUDA has them built in) */
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
/* ONNX max/min/Relu/Clip propagate NaN (C's fmaxf/fminf drop it); as selects, not fmaxf calls, so that
   the element loops vectorise (a ReLU: 8 -> 0.8 ns an element); Python-style float Mod */
static inline float pf_fmaxf(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
static inline float pf_fminf(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
static inline double pf_fmax(double a, double b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
static inline double pf_fmin(double a, double b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
static inline float pf_floor_modf(float a, float b) { const float r = fmodf(a, b); return r != 0.0f ? (((r < 0.0f) != (b < 0.0f)) ? r + b : r) : (b < 0.0f ? -0.0f : 0.0f); }
static inline double pf_floor_mod(double a, double b) { const double r = fmod(a, b); return r != 0.0 ? (((r < 0.0) != (b < 0.0)) ? r + b : r) : (b < 0.0 ? -0.0 : 0.0); }
/* floored division and modulo (GIR semantics); divisors are positive constants */
static inline long long pf_floordiv(long long a, long long b) { long long q = a / b; return q - ((a % b) < 0); }
static inline long long pf_mod(long long a, long long b) { long long r = a % b; return r + (r < 0 ? b : 0); }
/* exp, tanh and erf of float32 without libm calls, branch-free so that the element loops
   vectorise (libm's expf/tanhf/erff are scalar calls of 10-20 ns each, most of a GELU or
   softmax kernel's time); within 2 ulp (exp) and 2e-7 (tanh, erf: absolute and relative to
   max(|f|, 1e-7)) of the float64 value; NaN and infinities as C's. */
static inline float pf_expf(float x) {
  float xc = x > 89.0f ? 89.0f : (x < -104.0f ? -104.0f : x);       /* NaN passes through */
  float n = __builtin_rintf(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f + n * 2.12194440e-4f;             /* Cody-Waite: x - n ln 2 */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int ni = (int)n, n1 = ni / 2, n2 = ni - n1;                       /* 2^n in two factors: n in [-151, 129] */
  uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, 4); memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}
static inline float pf_tanhf(float x) {
  float a = fabsf(x), z = x * x;
  float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z
                 + 1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  float big = 1.0f - 2.0f / (pf_expf(2.0f * a) + 1.0f);
  return a < 0.625f ? small : copysignf(big, x);
}
static inline float pf_erff(float x) {
  float a = fabsf(x), z = x * x;
  float small = x * ((((((7.853861353153693e-5f * z - 8.010193625184903e-4f) * z + 5.188327685732524e-3f) * z
                - 2.685381193529856e-2f) * z + 1.128358514861418e-1f) * z - 3.761262582423300e-1f) * z
                + 1.128379165726710f);
  float ac = a < 6.0f ? a : 6.0f;
  float t = 1.0f / (1.0f + 0.5f * ac);
  float erfc = t * pf_expf(-ac * ac - 1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f
               + t * (-0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f
               + t * (-0.82215223f + t * 0.17087277f)))))))));
  float big = copysignf(1.0f - erfc, x);
  return a < 1.0f ? small : (a == a ? big : x);
}
#endif"""


class CPURenderer(CRenderer):
    lanes = 1
    extension = ".c"
    kernel_prefix = "PF_KERNEL"   # external in a plan's .c files; static inside a module
    header = C_HELPERS
    barrier = "/* block barrier: program order */ (void)0"
    warp_sync = "(void)0"
    shared = ""
    restrict = "restrict"
    launch_bounds = ""
    skeleton_package = "powerfusion.backends.cpu"
    skeleton = "kernel.j2"
    ctype = {**CRenderer.ctype, "float16": "_Float16", "bfloat16": "pf_bf16", "int16": "int16_t",
             "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t", "int64": "long long",
             "float4_e2m1fn": "uint8_t"}
    to_float = {"float16": "((float)({}))", "bfloat16": "pf_bf16_to_f({})", "float4_e2m1fn": "pf_e2m1_to_f({})"}
    from_float = {"float16": "((_Float16)({}))", "bfloat16": "pf_f_to_bf16({})", "float4_e2m1fn": "pf_f_to_e2m1({})"}
    vector_type: dict = {}   # no hand-written vector moves: the compiler vectorises the element loops
    # float sums down a tile (a GEMV row's dot, a pooling window) as SIMD partial sums: a serial
    # chain of adds is an add's latency an element (mobilenet_v3_small's classifier GEMVs 1.3 ms)
    sum_pragma = "#pragma omp simd reduction(+:acc)"
    device_faults = False    # integer division: scalar() refuses it (the GIR executor checks the divisor)

    def ptr_cast(self, ctype: str, value: str) -> str:
        return f"(({ctype}*)({value}))"

    def shfl_xor(self, value: str, mask: int) -> str:
        raise RenderError("a lane exchange on the CPU target (one lane per unit)")

    def scalar(self, fn: str, params: dict, operands: list[str], out_dtype: str) -> str:
        # C integer division by zero traps (SIGFPE ends the process); the GIR executor refuses a
        # zero divisor with a DataError, as onnxruntime does, so such a subgraph stays there
        if fn in ("div", "rem", "mod") and not out_dtype.startswith(("float", "bfloat")):
            raise RenderError(f"integer {fn} ({out_dtype}) runs on the GIR executor, which checks the divisor")
        text = super().scalar(fn, params, operands, out_dtype)   # NaN-propagating max/min (pf_fmaxf)
        if out_dtype != "float64":   # float64 keeps libm (the inline forms are float32's)
            text = _INLINE_MATH.sub(r"pf_\1(", text)
        return text

    def render(self, graph: GIRGraph) -> list[KernelSource]:
        _one_lane(graph)
        return [self.render_kernel(graph, ops, k) for k, ops in enumerate(graph.kernels())]

    def render_kernel(self, graph: GIRGraph, ops, k: int) -> KernelSource:
        _one_lane(graph)
        return CPUKernelRenderer(self, graph, ops, f"{sanitize(graph.name)}_k{k}").render()


def _one_lane(graph: GIRGraph) -> None:
    if graph.parallel.units_per_group != 1 or graph.parallel.lanes != 1:
        raise RenderError(f"GIR graph {graph.name} was planned for {graph.parallel.units_per_group} unit(s) "
                          f"of {graph.parallel.lanes} lane(s) per group; the CPU target runs one unit of one lane")


class _FlatTile(RegLayout):
    """A register tile of one lane: element (i, j) of any identity-layout slice is slot
    i * width + j, so every tile has the same layout whatever its slices' widths (equal
    layouts are what the shared kernel renderer checks); `slots` only sizes the declaration."""

    def __eq__(self, other):
        return isinstance(other, RegLayout) and not other.replicated and other.vec == 1

    def __hash__(self):
        return 1


class CPUKernelRenderer(KernelRenderer):
    def _lane_loop(self, s: MemorySlice, body: list[str]) -> list[str]:
        """A register tile's elements as one flat loop over its slots where the body does not
        name i or j (elementwise ops), else as rows of j: the shared renderer's three-deep
        unrolled nest (lanes, vector slots) kept gcc to 4-wide vectors, or none, on a
        hard-swish (a 47k-element one 31 -> 14 us). Tiles of fewer than FLAT_MIN_SLOTS keep the
        nest, which gcc unrolls whole (a hard-swish of 7-slot tiles 15 us nested, 25 us flat)."""
        if s.level != Level.REGISTER or self.reg[s.buffer].replicated or s.num * s.width < FLAT_MIN_SLOTS:
            return super()._lane_loop(s, body)
        if not _NAMES_IJ.search("\n".join(body)):
            return [f"for (int slot = 0; slot < {s.num * s.width}; ++slot) {{", *["  " + b for b in body], "}"]
        return [f"for (int i = 0; i < {s.num}; ++i)",
                f"for (int j = 0; j < {s.width}; ++j) {{ const int slot = i * {s.width} + j;",
                *["  " + b for b in body], "}"]

    def _broadcast(self, op: GOp) -> list[str]:
        """A broadcast over num reads its source at j, not at `slot % width`: in a flat tile the
        two are equal, but gcc made the modulo a gather from the stack per vector (a
        batch-norm scale of 350k elements 0.29 -> 0.03 ms, one thread); j is a loop counter."""
        (src,), (dst,) = op.inputs, op.outputs
        if op.args.over == "width" or self.reg[dst.buffer].replicated:
            return super()._broadcast(op)
        return self._lane_loop(dst, [f"{self.ref(dst, 'slot')} = {self.ref(src, 'j')};"])

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
        # the kernel's own (live) units, not the graph's: a one-unit bias add after a GEMV over
        # 1024 units forked threads for nothing (5 us a call with passive waiting)
        units = ks.grid[0]
        work = units * sum(s.num * s.width for op in ops for s in op.inputs + op.outputs)
        parts.append(f"#define PF_PARALLEL_{ks.name} {int(units > 1 and work >= PARALLEL_MIN_ELEMENTS)}\n{ks.source}")
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
