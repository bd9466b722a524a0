"""Range-aware simplification of index expressions: equal values before and after over the
bounds (property checks), the rules one by one (before / bounds / expected), and the
channel-shuffle and involution addresses collapsing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume as hyp_assume, given, settings, strategies as st

from powerfusion.gir.expr import (BinOp, Const, I, J, Load, U, Var, emax, emin, evaluate, select)
from powerfusion.gir.simplify import simplify, size

GATHER = np.array([3, -7, 0, 12, 5, 900, -1, 44], dtype=np.int64)


def _samples(lo: int, hi: int, rng: np.random.Generator, n: int = 12) -> np.ndarray:
    """The ends of [lo, hi), their neighbours and random points inside."""
    edge = [lo, lo + 1, hi - 2, hi - 1]
    pts = np.concatenate([np.array(edge), rng.integers(lo, hi, n)])
    return np.unique(np.clip(pts, lo, hi - 1))


def _grid(bounds, seed=0):
    rng = np.random.default_rng(seed)
    u = _samples(*bounds["u"], rng)[:, None, None]
    i = _samples(*bounds["i"], rng)[None, :, None]
    j = _samples(*bounds["j"], rng)[None, None, :]
    return {"u": u, "i": i, "j": j}


def _values(e, env):
    shape = np.broadcast_shapes(*(v.shape for v in env.values()))
    return np.broadcast_to(np.asarray(evaluate(e, env, {"g": GATHER}), dtype=np.int64), shape)


def _check_equal(before, after, bounds, assume=None, seed=0):
    env = _grid(bounds, seed)
    want, got = _values(before, env), _values(after, env)
    where = np.ones(want.shape, bool) if assume is None else _values(assume, env).astype(bool)
    bad = np.argwhere((want != got) & where)
    assert bad.size == 0, (f"before: {before!r}\nafter: {after!r}\nbounds: {bounds}\n"
                           f"first difference at {bad[0]}: {want[tuple(bad[0])]} vs {got[tuple(bad[0])]}")


def _evaluable(e, bounds):
    """numpy cannot subtract booleans (comparison - comparison): such inputs are skipped."""
    try:
        _values(e, _grid(bounds))
    except TypeError:
        hyp_assume(False)


# ---- random expressions from the GIR constructors -------------------------------------------
_DIVISORS = st.sampled_from([1, 2, 3, 4, 7, 8, 16, 28, 56, 58, 64, 784, 3248])
_LEAVES = st.one_of(st.sampled_from([U, I, J]), st.integers(-60, 300).map(Const))


def _extend(children):
    k = st.integers(-40, 40)
    return st.one_of(
        st.tuples(children, children).map(lambda ab: ab[0] + ab[1]),
        st.tuples(children, children).map(lambda ab: ab[0] - ab[1]),
        st.tuples(children, k).map(lambda ak: ak[0] * ak[1]),
        st.tuples(children, _DIVISORS).map(lambda ak: ak[0] // ak[1]),
        st.tuples(children, _DIVISORS).map(lambda ak: ak[0] % ak[1]),
        st.tuples(children, children).map(lambda ab: emin(ab[0], ab[1])),
        st.tuples(children, children).map(lambda ab: emax(ab[0], ab[1])),
        st.tuples(st.sampled_from(["lt", "le", "eq", "ne"]), children, children)
          .map(lambda oab: BinOp(oab[0], oab[1], oab[2])),
        st.tuples(st.sampled_from(["and", "or"]), children, children)
          .map(lambda oab: BinOp(oab[0], oab[1], oab[2])),
        st.tuples(children, children, children).map(lambda cab: select(cab[0].lt(cab[1]), cab[1], cab[2])),
        children.map(lambda a: Load("g", a)),
        # a divisor that is not a constant: left alone by the rules, its operands still simplify
        st.tuples(children, children).map(lambda ab: BinOp("floordiv", ab[0], ab[1] % 5 + 1)),
    )


EXPRS = st.recursive(_LEAVES, _extend, max_leaves=24)
BOUNDS = st.fixed_dictionaries({
    "u": st.tuples(st.integers(-30, 50), st.integers(1, 5000)).map(lambda t: (t[0], t[0] + t[1])),
    "i": st.integers(1, 8).map(lambda n: (0, n)),
    "j": st.tuples(st.integers(-40, 0), st.integers(1, 300)).map(lambda t: (t[0], t[0] + t[1])),
})


@settings(max_examples=400, deadline=None)
@given(EXPRS, BOUNDS, st.integers(0, 3))
def test_random_expressions_keep_their_values(e, bounds, seed):
    _evaluable(e, bounds)
    out = simplify(e, bounds)
    _check_equal(e, out, bounds, seed=seed)
    again = simplify(out, bounds)
    _check_equal(e, again, bounds, seed=seed)
    assert size(again) <= size(out) + 2, f"{out!r}\n-> {again!r}"


@settings(max_examples=200, deadline=None)
@given(EXPRS, EXPRS, BOUNDS, st.integers(-50, 300))
def test_values_kept_where_the_assumption_holds(e, a, bounds, c):
    _evaluable(e, bounds)
    _evaluable(a, bounds)
    assume = a.lt(c) & J.ge(bounds["j"][0] + 1)
    out = simplify(e, bounds, assume)
    _check_equal(e, out, bounds, assume=assume)


# ---- the rules, before / bounds / expected ------------------------------------------------------
B = {"u": (0, 1000), "i": (0, 4), "j": (0, 28)}
RULES = [
    ("floordiv(k*a + b, k) -> a", (U * 28 + J) // 28, B, U),
    ("mod(k*a + b, k) -> b", (U * 28 + J) % 28, B, J),
    ("floordiv(x, k) -> 0 in range", J // 28, B, Const(0)),
    ("mod(x, k) -> x in range", J % 28, B, J),
    ("floordiv(floordiv(x, a), b) -> floordiv(x, a*b)", (U // 4) // 8, B, U // 32),
    ("mod(mod(x, a), b) -> mod(x, b) when b | a", (U % 12) % 4, B, U % 4),
    ("like terms collect", U * 3 + J - U * 2 + 5 - 5, B, U + J),
    ("constant folding", (Const(6) + U - U) * 7, B, Const(42)),
    ("decided comparison", J.lt(28), B, Const(1)),
    ("decided comparison (false)", Const(28).le(J), B, Const(0)),
    ("true && x -> x", J.lt(100) & U.lt(10), B, U.lt(10)),
    ("select on a decided condition", select(I.lt(4), U, J), B, U),
    ("mixed radix peel", ((U % 3) * 28 + J) // 56, B, (U % 3) // 2),
    ("mixed radix digit", ((U * 28 + J) % 784) // 28, B, U % 28),
    ("min by ranges", emin(J, U + 28), B, J),
    ("comparison peel", (J + (U % 2) * 116).lt(116), {"u": (0, 1000), "i": (0, 1), "j": (0, 100)},
     (U % 2).lt(1)),
]


@pytest.mark.parametrize("name,before,bounds,expected", RULES, ids=[r[0] for r in RULES])
def test_rule(name, before, bounds, expected):
    after = simplify(before, bounds)
    assert after == expected, f"{name}\nbefore:   {before!r}\nexpected: {expected!r}\nafter:    {after!r}"
    _check_equal(before, after, bounds)


def test_the_right_side_of_and_knows_the_left():
    bounds = {"u": (0, 1000), "i": (0, 1), "j": (0, 128)}
    e = J.lt(28) & ((U * 28 + J) // 28).lt(1000)
    assert simplify(e, bounds) == J.lt(28)


def test_select_branches_know_their_condition():
    bounds = {"u": (0, 1000), "i": (0, 1), "j": (0, 128)}
    e = select(J.lt(28), (U * 28 + J) % 28, Const(-1))
    assert simplify(e, bounds) == select(J.lt(28), J, Const(-1))


def test_a_rewrite_that_would_widen_past_int32_keeps_the_input():
    # distributing gives u*4000 - 2*10**9, whose first term passes int32; the input stays within it
    e = (U + -500_000) * 4000
    assert simplify(e, {"u": (0, 1_000_000)}) == e
    assert simplify(e, {"u": (0, 1_000_000)}, limit=2**62) == U * 4000 + -2_000_000_000


def test_opaque_terms_stay():
    raw = Var("ri")                       # no bounds given: any integer
    e = (raw * 28 + J) % 28
    assert simplify(e, B) == J            # the multiple of 28 drops whatever ri is
    e2 = simplify((Load("g", U) + J) // 28, B)
    assert e2.op == "floordiv" and e2.b == Const(28)   # a load's range is unknown: the division stays


# ---- whole addresses of the benchmark cases -----------------------------------------------------
def _channel_shuffle():
    """Concat + Reshape + Transpose + Reshape + Split of 64x232x28x28, as the rewrite leaves it."""
    t = (U % 3248) * 28 + (U // 3248) * 181888 + J
    x = ((t % 784) // 28 + ((t % 181888) // 1568) * 28) + ((t % 1568) // 784) * 3248 + (t // 181888) * 6496
    addr = (x % 6496) * 28 + (x // 6496) * 90944 + t % 28
    valid = (I * 128 + J).lt(28) & Const(0).le((x // 28) % 232) & ((x // 28) % 232).lt(116)
    return addr, valid, {"u": (0, 207872), "i": (0, 1), "j": (0, 128)}


def test_channel_shuffle_address_collapses():
    addr, valid, bounds = _channel_shuffle()
    plain = simplify(addr, bounds)
    assert size(plain) * 3 < size(addr)
    _check_equal(addr, plain, bounds)
    guarded = simplify(addr, bounds, valid)            # the address is read only where valid holds
    assert size(guarded) * 5 < size(addr), guarded
    _check_equal(addr, guarded, bounds, assume=valid)
    v = simplify(valid, bounds)
    assert size(v) * 5 < size(valid), v
    _check_equal(valid, v, bounds)
    assert simplify(guarded, bounds, valid) == guarded   # idempotent


def test_involution_window_guard_collapses():
    """A 3x3 window over a 56x56 plane padded to 58x58: the tap's row/column guards."""
    t = (U % 56) * 58 + (U // 56) * 3364 + J + 1
    row, col = (t // 58) % 58 - 1, t % 58 - 1
    valid = Const(0).le(row) & row.lt(56) & Const(0).le(col) & col.lt(56) & J.lt(56) & (I * 128 + J).lt(56)
    bounds = {"u": (0, 59392), "i": (0, 1), "j": (0, 128)}
    out = simplify(valid, bounds)
    assert size(out) * 5 < size(valid), out
    _check_equal(valid, out, bounds)


def test_long_chains_stay_linear():
    """Deep nests simplify (memoised, one pass) and keep their values."""
    e = U
    for n in range(60):
        e = (e * 3 + J) % 97 if n % 2 else (e + n) // 2
    bounds = {"u": (0, 5000), "i": (0, 1), "j": (0, 64)}
    out = simplify(e, bounds)
    _check_equal(e, out, bounds)
    wide = Const(0)
    for n in range(150):
        wide = wide + (U + n) // 4 * (n % 7 + 1)
    _check_equal(wide, simplify(wide, bounds), bounds)


def test_comparisons_count_as_integers_in_arithmetic():
    """(u < i) + (u < i) is 2 where u < i, as in C; numpy alone would add the booleans to True."""
    import numpy as np
    e = U.lt(I) + U.lt(I)
    assert evaluate(e, {"u": np.array([0, 1]), "i": np.array([1, 1])}).tolist() == [2, 0]
    _check_equal(e, simplify(e, {"u": (0, 1), "i": (0, 2), "j": (0, 1)}), {"u": (0, 1), "i": (0, 2), "j": (0, 1)})
