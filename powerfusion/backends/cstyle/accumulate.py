"""Reduction accumulators of emitted C: the accumulator type, identity and combine of a
reduction per dtype, and the online update of a reduce(sumexp) state. Shared by the plain
rendering (kernel.py) and the streamed one (streaming.py)."""
from __future__ import annotations

import numpy as np

_IDENTITY = {"sum": "0.0f", "prod": "1.0f", "max": "(-INFINITY)", "min": "(INFINITY)"}
# max/min combine with the dialect's NaN-propagating helpers (renderer.nan_propagating says why)
_COMBINE = {"sum": "({a} + {b})", "prod": "({a} * {b})", "max": "pf_fmaxf({a}, {b})", "min": "pf_fminf({a}, {b})"}
# integer and bool reductions accumulate exactly in 64-bit integers (a float accumulator
# rounds sums above 2^24 and turns an empty max's -inf into true)
_INT_IDENTITY = {"sum": "0LL", "prod": "1LL", "max": "(-9223372036854775807LL - 1)", "min": "9223372036854775807LL"}
_BOOL_IDENTITY = {"sum": "0LL", "prod": "1LL", "max": "0LL", "min": "1LL"}
_INT_COMBINE = {"sum": "({a} + {b})", "prod": "({a} * {b})", "max": "(({a}) > ({b}) ? ({a}) : ({b}))",
                "min": "(({a}) < ({b}) ? ({a}) : ({b}))"}


def sumexp_push(m: str, s: str, x: str, dtype: str) -> str:
    """One element x into a reduce(sumexp) state (running max m, sum s of exp(. - m)): the sum
    is rescaled when the max grows (online softmax); one exp per element."""
    t, e = ("double", "exp") if dtype == "float64" else ("float", "expf")
    return (f"{{ const {t} x_ = {x}; if (x_ > {m}) {{ {s} = {s} * {e}({m} - x_) + ({t})1; {m} = x_; }} "
            f"else {{ {s} += (x_ == {m}) ? ({t})1 : {e}(x_ - {m}); }} }}")


def accumulator(dtype: str, fn: str) -> tuple[str, str, str]:
    """(C type, identity, combine template) of a reduction's accumulator for `dtype`."""
    kind = "f" if dtype == "bfloat16" else np.dtype(dtype).kind
    if kind == "b":   # false/true bound a bool max/min (the int64 extremes would cast to true)
        return "long long", _BOOL_IDENTITY[fn], _INT_COMBINE[fn]
    if kind in "iu":
        return "long long", _INT_IDENTITY[fn], _INT_COMBINE[fn]
    if dtype == "float64":
        return "double", _IDENTITY[fn].replace("0f", "0"), _COMBINE[fn].replace("fmaxf", "fmax").replace("fminf", "fmin")
    return "float", _IDENTITY[fn], _COMBINE[fn]
