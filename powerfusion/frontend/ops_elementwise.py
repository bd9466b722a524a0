"""Converters for elementwise ONNX ops (arithmetic, activations, comparisons, logic, casts)."""
from __future__ import annotations

import math

import numpy as np
import onnx

from powerfusion.frontend.builder import NodeCtx

UNARY = {"Sqrt": "sqrt", "Reciprocal": "reciprocal", "Neg": "neg", "Abs": "abs", "Exp": "exp", "Log": "log",
         "Erf": "erf", "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu", "Not": "not", "IsNaN": "isnan",
         "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign", "Sin": "sin", "Cos": "cos",
         "Tan": "tan", "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh",
         "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "BitwiseNot": "bitwise_not"}
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Equal": "equal", "Less": "less",
          "Greater": "greater", "LessOrEqual": "less_equal", "GreaterOrEqual": "greater_equal", "And": "and",
          "Or": "or", "Xor": "xor", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or",
          "BitwiseXor": "bitwise_xor"}
VARIADIC = {"Sum": "add", "Max": "max", "Min": "min"}


def unary(fn):
    def convert(cx: NodeCtx):
        cx.ew(fn, cx.inp(0), out=cx.out())
    return convert


def binary(fn):
    def convert(cx: NodeCtx):
        cx.ew(fn, cx.inp(0), cx.inp(1), out=cx.out())
    return convert


def variadic(fn):
    def convert(cx: NodeCtx):
        names = [cx.inp(i) for i in range(cx.n_in())]
        if len(names) == 1:
            cx.alias(names[0], cx.out())
            return
        acc = names[0]
        for k, n in enumerate(names[1:]):
            acc = cx.ew(fn, acc, n, out=cx.out() if k == len(names) - 2 else None)
    return convert


def convert_mean(cx: NodeCtx):
    names = [cx.inp(i) for i in range(cx.n_in())]
    acc = names[0]
    for n in names[1:]:
        acc = cx.ew("add", acc, n)
    cx.ew("mul", acc, cx.scalar(1.0 / len(names), cx.dtype(0)), out=cx.out())


def convert_pow(cx: NodeCtx):
    x, dt = cx.inp(0), cx.dtype(0)
    e = cx.const(1)
    # common exponents become cheaper, more exact ops; the result shape must still broadcast
    if e is not None and e.size == 1 and np.broadcast_shapes(cx.shape(0), e.shape) == cx.shape(0):
        v = float(e.reshape(-1)[0])
        if v == 1.0:
            cx.alias(x, cx.out())
            return
        if v == 2.0:
            cx.ew("mul", x, x, out=cx.out())
            return
        if v == 3.0 and dt.itemsize >= 4:   # GELU's tanh form: x*x*x, not powf (~20x the work)
            cx.ew("mul", cx.ew("mul", x, x), x, out=cx.out())
            return
        if v == 3.0 and dt.kind == "f":     # 16-bit floats: one op, so one rounding (as pow)
            cx.ew("cube", x, out=cx.out())
            return
        if v == 0.5 and dt.kind == "f":
            cx.ew("sqrt", x, out=cx.out())
            return
    cx.ew("pow", x, cx.cast(cx.inp(1), dt), out=cx.out())


RECIPROCAL_REUSE = 4   # a float divisor shared by at least this many outputs becomes a reciprocal


def convert_div(cx: NodeCtx):
    """a / b. When each divisor serves many outputs (a row's norm, a scalar), a * (1 / b)
    instead: one division per divisor, a multiply per output. The reciprocal is formed in
    float32: float32 results are within one ulp of a / b. 16-bit operands multiply by the
    reciprocal rounded to their dtype (an op on mixed float widths would split the row's
    vector loads), so the result is rounded twice: within one 16-bit ulp of a / b rather than
    half an ulp. float64 and integer division, and divisors used once, stay divisions. A
    divisor below 2**-126 in magnitude (subnormal) overflows the reciprocal to inf where a / b
    would be finite."""
    a, b, dt = cx.inp(0), cx.inp(1), cx.dtype(0)
    out_size = math.prod(np.broadcast_shapes(cx.shape(0), cx.shape(1)))
    if dt.name not in ("float32", "float16", "bfloat16") or cx.info(b).size * RECIPROCAL_REUSE > out_size:
        cx.ew("div", a, b, out=cx.out())
        return
    c = cx.const(1)
    if c is not None:   # a constant divisor: its reciprocal is a constant too
        with np.errstate(divide="ignore"):
            r = cx.b.constant(np.reciprocal(np.asarray(c, np.float32)).astype(dt), hint="reciprocal")
    else:
        r = cx.cast(cx.ew("reciprocal", cx.cast(b, np.float32)), dt)
    cx.ew("mul", a, r, out=cx.out())


def convert_leaky_relu(cx: NodeCtx):
    cx.ew("leaky_relu", cx.inp(0), out=cx.out(), params=(("alpha", float(cx.attr("alpha", 0.01))),))


def convert_hard_sigmoid(cx: NodeCtx):
    params = (("alpha", float(cx.attr("alpha", 0.2))), ("beta", float(cx.attr("beta", 0.5))))
    cx.ew("hard_sigmoid", cx.inp(0), out=cx.out(), params=params)


def convert_hard_swish(cx: NodeCtx):
    x = cx.inp(0)
    hs = cx.ew("hard_sigmoid", x, params=(("alpha", 1.0 / 6.0), ("beta", 0.5)))
    cx.ew("mul", x, hs, out=cx.out())


def convert_clip(cx: NodeCtx):
    dt = cx.dtype(0)
    if cx.opset < 11:
        lo, hi = cx.attr("min", None), cx.attr("max", None)
    else:
        lo, hi = _clip_bound(cx, 1), _clip_bound(cx, 2)
    big = float(np.iinfo(dt).max) if dt.kind in "iu" else math.inf
    small = float(np.iinfo(dt).min) if dt.kind in "iu" else -math.inf
    lo = small if lo is None else float(lo)
    hi = big if hi is None else float(hi)
    cx.ew("clip", cx.inp(0), out=cx.out(), params=(("lo", lo), ("hi", hi)))


def _clip_bound(cx: NodeCtx, i: int):
    if not cx.has(i):
        return None
    v = cx.const(i)
    if v is None:
        cx.fail(f"Clip bound input {i} must be a constant (a run-time bound is not supported)")
    return float(np.asarray(v).reshape(-1)[0])


def convert_gelu(cx: NodeCtx):
    x, dt = cx.inp(0), cx.dtype(0)
    approx = cx.attr("approximate", "none")
    if approx == "tanh":
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        x3 = cx.ew("mul", cx.ew("mul", x, x), x)
        inner = cx.ew("add", x, cx.ew("mul", x3, cx.scalar(0.044715, dt)))
        t = cx.ew("tanh", cx.ew("mul", inner, cx.scalar(math.sqrt(2.0 / math.pi), dt)))
    elif approx == "none":
        t = cx.ew("erf", cx.ew("mul", x, cx.scalar(1.0 / math.sqrt(2.0), dt)))
    else:
        cx.fail(f"unknown approximate='{approx}' (expected 'none' or 'tanh')")
    half_x = cx.ew("mul", x, cx.scalar(0.5, dt))
    cx.ew("mul", half_x, cx.ew("add", t, cx.scalar(1.0, dt)), out=cx.out())


def convert_where(cx: NodeCtx):
    cx.ew("where", cx.inp(0), cx.inp(1), cx.inp(2), out=cx.out())


SATURATING = {onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2,
              onnx.TensorProto.FLOAT8E5M2FNUZ}


def _cast_to(cx: NodeCtx, to: int):
    """ONNX Cast semantics: saturate (default 1) clamps to a float8 type's finite range."""
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
    fn = "cast_saturate" if to in SATURATING and cx.attr("saturate", 1) else "cast"
    cx.ew(fn, cx.inp(0), out=cx.out(), params=(("to", dtype),))


def convert_cast(cx: NodeCtx):
    _cast_to(cx, cx.attr("to"))


def convert_cast_like(cx: NodeCtx):
    _cast_to(cx, onnx.helper.np_dtype_to_tensor_dtype(cx.dtype(1)))


def convert_mod(cx: NodeCtx):
    if cx.dtype(0).kind in "iu":
        fn = "rem" if cx.attr("fmod", 0) else "mod"
    else:
        fn = "fmod" if cx.attr("fmod", 0) else "floor_mod"
    cx.ew(fn, cx.inp(0), cx.inp(1), out=cx.out())


def convert_is_inf(cx: NodeCtx):
    pos, neg = cx.attr("detect_positive", 1), cx.attr("detect_negative", 1)
    x = cx.inp(0)
    if pos and neg:
        cx.ew("isinf", x, out=cx.out())
    elif pos or neg:
        cx.ew("isposinf" if pos else "isneginf", x, out=cx.out())
    else:
        cx.b.constant(np.zeros(cx.shape(0), dtype=bool), name=cx.out())


def convert_shrink(cx: NodeCtx):
    x, dt = cx.inp(0), cx.dtype(0)
    lambd, bias = float(cx.attr("lambd", 0.5)), float(cx.attr("bias", 0.0))
    low = cx.ew("less", x, cx.scalar(-lambd, dt))
    high = cx.ew("greater", x, cx.scalar(lambd, dt))
    up = cx.ew("add", x, cx.scalar(bias, dt))
    down = cx.ew("sub", x, cx.scalar(bias, dt))
    cx.ew("where", low, up, cx.ew("where", high, down, cx.scalar(0, dt)), out=cx.out())


def convert_identity(cx: NodeCtx):
    cx.alias(cx.inp(0), cx.out())


def _negative_branch(cx: NodeCtx, x: str, neg: str, out: str | None):
    """x where x >= 0, `neg` elsewhere."""
    return cx.ew("where", cx.ew("less", x, cx.scalar(0, cx.dtype(0))), neg, x, out=out)


def convert_prelu(cx: NodeCtx):
    x = cx.inp(0)
    _negative_branch(cx, x, cx.ew("mul", x, cx.inp(1)), cx.out())


def _expm1_scaled(cx: NodeCtx, x: str, alpha: float) -> str:
    dt = cx.dtype(0)
    return cx.ew("mul", cx.ew("sub", cx.ew("exp", x), cx.scalar(1, dt)), cx.scalar(alpha, dt))


def convert_elu(cx: NodeCtx):
    x = cx.inp(0)
    _negative_branch(cx, x, _expm1_scaled(cx, x, float(cx.attr("alpha", 1.0))), cx.out())


def convert_selu(cx: NodeCtx):
    x = cx.inp(0)
    alpha, gamma = float(cx.attr("alpha", 1.67326319217681884765625)), float(cx.attr("gamma", 1.05070102214813232421875))
    e = _negative_branch(cx, x, _expm1_scaled(cx, x, alpha), None)
    cx.ew("mul", e, cx.scalar(gamma, cx.dtype(0)), out=cx.out())


def _softplus(cx: NodeCtx, x: str, out=None) -> str:
    # relu(x) + log(1 + exp(-|x|)): no overflow for large |x|
    dt = cx.dtype(0)
    tail = cx.ew("log", cx.ew("add", cx.ew("exp", cx.ew("neg", cx.ew("abs", x))), cx.scalar(1, dt)))
    return cx.ew("add", cx.ew("relu", x), tail, out=out)


def convert_softplus(cx: NodeCtx):
    _softplus(cx, cx.inp(0), out=cx.out())


def convert_softsign(cx: NodeCtx):
    x = cx.inp(0)
    cx.ew("div", x, cx.ew("add", cx.ew("abs", x), cx.scalar(1, cx.dtype(0))), out=cx.out())


def convert_mish(cx: NodeCtx):
    x = cx.inp(0)
    cx.ew("mul", x, cx.ew("tanh", _softplus(cx, x)), out=cx.out())


CONVERTERS = {op: unary(fn) for op, fn in UNARY.items()}
CONVERTERS.update({op: binary(fn) for op, fn in BINARY.items()})
CONVERTERS.update({op: variadic(fn) for op, fn in VARIADIC.items()})
CONVERTERS.update({
    "Div": convert_div, "Mean": convert_mean, "Pow": convert_pow, "LeakyRelu": convert_leaky_relu, "HardSigmoid": convert_hard_sigmoid,
    "HardSwish": convert_hard_swish, "Clip": convert_clip, "Gelu": convert_gelu, "Where": convert_where,
    "Cast": convert_cast, "CastLike": convert_cast_like, "Mod": convert_mod,
    "IsInf": convert_is_inf, "Shrink": convert_shrink, "Identity": convert_identity, "PRelu": convert_prelu, "Elu": convert_elu,
    "Selu": convert_selu, "Softplus": convert_softplus, "Softsign": convert_softsign, "Mish": convert_mish,
})
