"""The scalar functions an elementwise gOperator may apply: one table shared by the
numpy interpreter, the CPU session and every C-style backend.

Arithmetic on fp16/bf16 data is done in fp32 (load, widen, compute, narrow, store),
as every backend does it; the numpy implementations below therefore receive
float32 (or bool / integer) arrays.

C templates use `{0}`, `{1}`, ... for operands and `{name}` for parameters, and
assume float operands; backends may override individual entries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True, slots=True)
class ScalarFn:
    name: str
    arity: int
    numpy: Callable
    c: str
    flops: int = 1               # rough cost per element, for the perf model
    result: str = "same"         # "same" | "bool" (comparisons) | "param:to" (cast)
    params: tuple[str, ...] = ()


_MATH_ERF = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """Exact (to double rounding) erf, elementwise."""
    return _MATH_ERF(np.asarray(x, dtype=np.float64)).astype(np.asarray(x).dtype)


def _cast(x, to):
    return x.astype(to)


def _cast_saturate(x, to):
    """ONNX Cast to a float8 type with saturate=1: out-of-range values (and infinities) become
    the largest finite value of that sign, NaN stays NaN; then round to nearest even."""
    import ml_dtypes
    info = ml_dtypes.finfo(to)
    return np.clip(x, float(info.min), float(info.max)).astype(to)


def _f(name, arity, fn, c, flops=1, result="same", params=()):
    return name, ScalarFn(name, arity, fn, c, flops, result, params)


SCALAR_FNS: dict[str, ScalarFn] = dict([
    # arithmetic
    _f("add", 2, np.add, "({0} + {1})"),
    _f("sub", 2, np.subtract, "({0} - {1})"),
    _f("mul", 2, np.multiply, "({0} * {1})"),
    _f("div", 2, lambda a, b: np.divide(a, b) if a.dtype.kind == "f" else _int_div(a, b), "({0} / {1})"),
    _f("pow", 2, np.power, "powf({0}, {1})", flops=8),
    # x**3 with one rounding (GELU's tanh form on 16-bit floats: a powf per element with the
    # exponent read from memory made GPT-2's fp16 GELU kernel compute-bound)
    _f("cube", 1, lambda x: x * x * x, "({0} * {0} * {0})", flops=2),
    _f("max", 2, np.maximum, "fmaxf({0}, {1})"),
    _f("min", 2, np.minimum, "fminf({0}, {1})"),
    _f("neg", 1, np.negative, "(-{0})"),
    _f("abs", 1, np.abs, "fabsf({0})"),
    _f("sqrt", 1, np.sqrt, "sqrtf({0})", flops=4),
    _f("rsqrt", 1, lambda x: 1 / np.sqrt(x), "rsqrtf({0})", flops=4),
    _f("reciprocal", 1, np.reciprocal, "(1.0f / {0})", flops=4),
    _f("exp", 1, np.exp, "expf({0})", flops=8),
    _f("log", 1, np.log, "logf({0})", flops=8),
    _f("erf", 1, erf, "erff({0})", flops=16),
    _f("tanh", 1, np.tanh, "tanhf({0})", flops=16),
    _f("sigmoid", 1, lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype), "(1.0f / (1.0f + expf(-{0})))", flops=10),
    # x < 0 ? 0 : x: NaN and -0.0 pass through, as in onnxruntime (max(x, 0) leaves the zero's sign open)
    _f("relu", 1, lambda x: np.where(x < 0, np.zeros((), x.dtype), x), "({0} < 0.0f ? 0.0f : {0})"),
    _f("leaky_relu", 1, lambda x, alpha: np.where(x >= 0, x, x * x.dtype.type(alpha)),
       "({0} >= 0.0f ? {0} : {0} * {alpha}f)", flops=2, params=("alpha",)),
    _f("clip", 1, lambda x, lo, hi: np.minimum(np.maximum(x, x.dtype.type(lo)), x.dtype.type(hi)),
       "fminf(fmaxf({0}, {lo}f), {hi}f)", flops=2, params=("lo", "hi")),
    _f("hard_sigmoid", 1, lambda x, alpha, beta: np.clip(x * x.dtype.type(alpha) + x.dtype.type(beta), 0, 1).astype(x.dtype),
       "fminf(fmaxf({0} * {alpha}f + {beta}f, 0.0f), 1.0f)", flops=4, params=("alpha", "beta")),
    _f("affine", 1, lambda x, alpha, beta: x * x.dtype.type(alpha) + x.dtype.type(beta),
       "({0} * {alpha}f + {beta}f)", flops=2, params=("alpha", "beta")),
    _f("identity", 1, lambda x: x, "{0}", flops=0),
    _f("floor", 1, np.floor, "floorf({0})"),
    _f("ceil", 1, np.ceil, "ceilf({0})"),
    _f("round", 1, np.round, "rintf({0})"),   # half to even, as ONNX Round (and C's default mode)
    _f("sign", 1, np.sign, "(({0} > 0) - ({0} < 0))", flops=2),
    _f("sin", 1, np.sin, "sinf({0})", flops=8),
    _f("cos", 1, np.cos, "cosf({0})", flops=8),
    _f("tan", 1, np.tan, "tanf({0})", flops=8),
    _f("asin", 1, np.arcsin, "asinf({0})", flops=8),
    _f("acos", 1, np.arccos, "acosf({0})", flops=8),
    _f("atan", 1, np.arctan, "atanf({0})", flops=8),
    _f("sinh", 1, np.sinh, "sinhf({0})", flops=8),
    _f("cosh", 1, np.cosh, "coshf({0})", flops=8),
    _f("asinh", 1, np.arcsinh, "asinhf({0})", flops=8),
    _f("acosh", 1, np.arccosh, "acoshf({0})", flops=8),
    _f("atanh", 1, np.arctanh, "atanhf({0})", flops=8),
    # remainders: fmod on floats; on integers truncated (rem, ONNX fmod=1) or floored (mod, fmod=0)
    _f("fmod", 2, np.fmod, "fmodf({0}, {1})", flops=4),
    _f("rem", 2, np.fmod, "({0} % {1})", flops=4),
    _f("mod", 2, np.mod, "((({0} % {1}) + {1}) % {1})", flops=6),
    # floats, the divisor's sign, exactly as numpy (x % inf, -0.0): every dialect defines pf_floor_modf
    _f("floor_mod", 2, np.mod, "pf_floor_modf({0}, {1})", flops=8),
    # bitwise, on integers
    _f("bitwise_and", 2, np.bitwise_and, "({0} & {1})"),
    _f("bitwise_or", 2, np.bitwise_or, "({0} | {1})"),
    _f("bitwise_xor", 2, np.bitwise_xor, "({0} ^ {1})"),
    _f("bitwise_not", 1, np.invert, "(~{0})"),
    # comparisons and logic (bool results)
    _f("equal", 2, np.equal, "({0} == {1})", result="bool"),
    _f("less", 2, np.less, "({0} < {1})", result="bool"),
    _f("greater", 2, np.greater, "({0} > {1})", result="bool"),
    _f("less_equal", 2, np.less_equal, "({0} <= {1})", result="bool"),
    _f("greater_equal", 2, np.greater_equal, "({0} >= {1})", result="bool"),
    _f("not", 1, np.logical_not, "(!{0})", result="bool"),
    _f("and", 2, np.logical_and, "({0} && {1})", result="bool"),
    _f("or", 2, np.logical_or, "({0} || {1})", result="bool"),
    _f("isnan", 1, np.isnan, "isnan({0})", result="bool"),
    _f("isinf", 1, np.isinf, "isinf({0})", result="bool"),
    _f("isposinf", 1, np.isposinf, "({0} == INFINITY)", result="bool"),
    _f("isneginf", 1, np.isneginf, "({0} == -INFINITY)", result="bool"),
    _f("xor", 2, np.logical_xor, "({0} != {1})", result="bool"),
    # selection and conversion
    _f("where", 3, np.where, "({0} ? {1} : {2})"),
    _f("cast", 1, _cast, "({to})({0})", flops=0, result="param:to", params=("to",)),
    # float8 results are cpu-only (frontend.converters.cpu_only_nodes): no C rendering saturates
    _f("cast_saturate", 1, _cast_saturate, "({to})({0})", flops=2, result="param:to", params=("to",)),
])


def _int_div(a, b):
    """ONNX integer Div: truncates toward zero (like C; numpy floors), exact for all of int64,
    and refuses a zero divisor as onnxruntime does (C would trap; numpy gives 0 or INT64_MIN)."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a, b)
    if dtype.kind == "b":
        dtype = np.dtype(np.uint8)
    if np.any(b == 0):
        from powerfusion.errors import DataError
        raise DataError(f"integer division by zero ({dtype.name} Div)")
    q = np.floor_divide(a.astype(dtype), b.astype(dtype))
    r = np.subtract(a.astype(dtype), np.multiply(q, b.astype(dtype)))
    return np.where((r != 0) & ((a < 0) != (b < 0)), q + 1, q).astype(dtype) if dtype.kind == "i" else q


def scalar_fn(name: str) -> ScalarFn:
    try:
        return SCALAR_FNS[name]
    except KeyError:
        raise KeyError(f"unknown scalar function '{name}' (known: {', '.join(sorted(SCALAR_FNS))})") from None
