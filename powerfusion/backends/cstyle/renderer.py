"""One C-style renderer for GPU backends: a rewritten GIR graph -> kernel sources.

A dialect subclass supplies its spellings (lanes, type names, conversions, barriers) and its
kernel skeleton (`skeleton_package`/templates/`skeleton`, a jinja2 template); the instruction
mapping per gOperator kind lives in kernel.py.

Mapping (docs/design.md): parallel unit = warp / wavefront; a group = a block of
`units_per_group` units; REGISTER buffers are distributed over the unit's lanes
(element (i, j) lives in lane (j // vec) % lanes at local slot
i * (width / lanes) + (j // (vec * lanes)) * vec + j % vec) or, for width-1 tiles,
replicated in every lane; SHARED buffers are per-block arrays; WARP syncs are
`__syncwarp`-style, BLOCK syncs a barrier, DEVICE syncs kernel boundaries.
"""
from __future__ import annotations

import re
from functools import cached_property

import jinja2

from powerfusion.backends.cstyle.kernel import KernelRenderer, c_float
from powerfusion.backends.source import KernelSource
from powerfusion.gir.ir import GIRGraph
from powerfusion.names import sanitize
from powerfusion.scalar import scalar_fn


class CRenderer:
    """CUDA-flavoured defaults; HIP overrides a handful of attributes."""
    lanes = 32
    skeleton_package = "powerfusion.backends.cuda"   # the dialect's folder holding templates/<skeleton>
    skeleton = "kernel.j2"
    kernel_prefix = 'extern "C" __global__'
    header = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <math_constants.h>"
    barrier = "__syncthreads()"
    warp_sync = "__syncwarp()"
    shared = "__shared__"
    restrict = "__restrict__"
    launch_bounds = "__launch_bounds__({threads})"
    ctype = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double",
             "int64": "long long", "int32": "int", "int8": "signed char", "uint8": "unsigned char", "bool": "bool"}
    to_float = {"float16": "__half2float({})", "bfloat16": "__bfloat162float({})"}
    from_float = {"float16": "__float2half_rn({})", "bfloat16": "__float2bfloat16_rn({})"}
    vector_type = {4: "unsigned int", 8: "uint2", 16: "uint4"}
    sum_pragma = ""   # before a float sum's loop down a register tile's segments ("": #pragma unroll)
    # integer division checks its divisor in the kernel and records a fault for the host
    # (backends/cstyle/faults.py); a dialect without that refuses integer division itself
    device_faults = True

    def trim_headers(self, source: str) -> str:
        """A rendered kernel with the headers it does not need left out (dialects that can tell)."""
        return source

    def ptr_cast(self, ctype: str, value: str) -> str:
        """`value` (a pointer) as a `ctype` pointer (C dialects spell it `((T*)(v))`)."""
        return f"reinterpret_cast<{ctype}*>({value})"

    def shfl_xor(self, value: str, mask: int) -> str:
        return f"__shfl_xor_sync(0xffffffffu, {value}, {mask})"

    @cached_property
    def env(self) -> jinja2.Environment:
        env = jinja2.Environment(loader=jinja2.PackageLoader(self.skeleton_package, "templates"),
                                 trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        return env

    # ---- public -------------------------------------------------------------------
    def render(self, graph: GIRGraph) -> list[KernelSource]:
        return [self.render_kernel(graph, ops, k) for k, ops in enumerate(graph.kernels())]

    def render_kernel(self, graph: GIRGraph, ops, k: int) -> KernelSource:
        """Kernel k of the graph (its gOperators `ops`, graph.kernels()[k]). What it renders, or
        the RenderError it raises, depends on the graph's name and parallel structure, these ops
        and the buffers they name, nothing else (the search remembers its verdicts by them)."""
        return KernelRenderer(self, graph, ops, f"{sanitize(graph.name)}_k{k}").render()

    def convert(self, value: str, src: str, dst: str) -> str:
        """C expression converting `value` of dtype src to dtype dst."""
        if src == dst:
            return value
        if src in self.to_float:
            value = self.to_float[src].format(value)
            src = "float32"
        if dst in self.from_float:
            return self.from_float[dst].format(value if src == "float32" else f"(float)({value})")
        return f"({self.ctype[dst]})({value})"

    def scalar(self, fn: str, params: dict, operands: list[str], out_dtype: str) -> str:
        f = scalar_fn(fn)
        tmpl = re.sub(r"\{(\w+)\}f", r"{\1}", f.c)
        kw = {}
        for p in f.params:
            v = params[p]
            kw[p] = self.ctype[_dtype_name(v)] if p == "to" else c_float(float(v))
        if fn == "cast":
            return self.convert(operands[0], "float32", out_dtype) if out_dtype in self.from_float else \
                f"({self.ctype[out_dtype]})({operands[0]})"
        text = nan_propagating(tmpl.format(*operands, **kw))
        return double_precision(text) if out_dtype == "float64" else text


# C's fmaxf/fminf return the other operand when one is NaN; ONNX Max/Min/Relu/Clip (and numpy,
# onnxruntime) give NaN. Every C-style dialect defines pf_fmaxf/pf_fminf (float) and
# pf_fmax/pf_fmin (double) as `(a != a || b != b) ? a + b : fmaxf(a, b)`: one compare more.
_NAN_DROPPING = re.compile(r"(?<![\w])(fmaxf|fminf|fmax|fmin)\(")


def nan_propagating(text: str) -> str:
    """`text` with C's NaN-dropping max/min replaced by the dialect's NaN-propagating helpers
    (idempotent: a helper's name is not matched again)."""
    return _NAN_DROPPING.sub(r"pf_\1(", text)


# The scalar templates are written for float32 (expf, 1.0f); C and CUDA would compute a float64
# operation through them in float32 (expf(double) converts its argument). A float64 result takes
# the double-precision names and literals instead; pf_floor_mod / pf_fmax / pf_fmin are every
# dialect's double helpers.
_FLOAT_NAMES = re.compile(r"(?<![\w])(acos|acosh|asin|asinh|atan|atanh|ceil|cos|cosh|erf|exp|fabs|floor|fmod|log|pow|"
                          r"rint|rsqrt|sin|sinh|sqrt|tan|tanh|pf_floor_mod|pf_fmax|pf_fmin)f\(")
_FLOAT_LITERAL = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)f(?![\w])")


def double_precision(text: str) -> str:
    """`text` with float32 math names and literals in their float64 spelling."""
    return _FLOAT_LITERAL.sub(r"\1", _FLOAT_NAMES.sub(r"\1(", text))


def _dtype_name(v) -> str:
    import numpy as np
    return np.dtype(v).name if not isinstance(v, str) else v
