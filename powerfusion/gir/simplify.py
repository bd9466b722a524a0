"""Range-aware simplification of index expressions (the rules of TVM's canonical simplifier).

Rewritten slices address elements through deep nests of floored // and % over u, i, j; most
of those operations cancel once the ranges of the variables are known: the unit id is below
the unit count, i below the slice's num, j below its width. `simplify(e, bounds)` rewrites an
expression into one that is equal for every integer assignment within `bounds`:

  * sums are kept as linear forms (terms times constant coefficients): like terms collect,
    constants fold, products by constants distribute;
  * floordiv(k*a + b, k) -> a + floordiv(b, k) and mod(k*a + b, k) -> mod(b, k);
    floordiv(x, k) / mod(x, k) fold when x stays in one bucket [q*k, q*k + k);
  * floordiv(d*a + b, d*m) -> floordiv(a + q, m) and mod(d*a + b, d*m) -> d*mod(a + q, m) + b - d*q
    when b stays in [d*q, d*q + d) (peels the low digit of a mixed-radix address);
  * floordiv(floordiv(x, a) + c, b) -> floordiv(x + c*a, a*b); c*mod(x, m) inside mod(., k)
    -> c*x when k divides c*m (so mod(mod(x, a), b) -> mod(x, b) when b divides a);
  * comparisons decided by ranges fold to 0/1 (guards vanish); the right side of `and`/`or`
    and the branches of `select` are simplified under the facts their condition gives
    (a comparison of one variable, or of one term, with a constant narrows its range).

Bounds are half-open, like `range`: {"u": (0, N)} means 0 <= u < N. Variables without bounds,
loads and renderer fragments are opaque (any integer). Divisors are positive constants in the
rules; anything else is left as it is. Integer semantics are exact (Python ints); the result's
intermediate values are never wider than the input's or than int32 (`limit`), so the emitted
idx_t overflows no more than before.
"""
from __future__ import annotations

import math
from typing import Mapping

from powerfusion.gir.expr import BinOp, Const, Expr, Load, Select, Var, loads

INF = math.inf
INT32_MAX = 2**31 - 1
_COMPARE = ("lt", "le", "eq", "ne")


def simplify(e: Expr, bounds: Mapping[str, tuple[int, int]], assume: Expr | None = None,
             limit: int = INT32_MAX) -> Expr:
    """An expression equal to `e` wherever the variables lie in `bounds` (half-open) and,
    when given, `assume` holds; `e` itself if the rewrite would widen an intermediate value
    beyond both `limit` and the widest intermediate of `e`."""
    facts = {Var(v): (lo, hi - 1) for v, (lo, hi) in bounds.items()}
    s = _Simplifier(facts)
    if assume is not None:
        s = s.under(s.simp(assume), True)
    out = s.simp(e)
    if out != e and _magnitude(s, out) > max(_magnitude(s, e), limit):
        return e
    return out


def size(e: Expr) -> int:
    """Node count (the measure the tests and the report use)."""
    if isinstance(e, BinOp): return 1 + size(e.a) + size(e.b)
    if isinstance(e, Select): return 1 + size(e.cond) + size(e.a) + size(e.b)
    if isinstance(e, Load): return 1 + size(e.index)
    return 1


Lin = tuple[dict, int]  # ({term: coefficient}, constant)


class _Simplifier:
    def __init__(self, facts: dict):
        self.facts = facts            # term -> (lo, hi) inclusive, assumed
        self.memo: dict = {}
        self.rmemo: dict = {}
        self.lmemo: dict = {}

    # ---- ranges -----------------------------------------------------------------------------
    def range(self, e: Expr) -> tuple:
        """Inclusive (lo, hi) of a simplified expression; +-inf when unknown."""
        r = self.rmemo.get(e)
        if r is None:
            r = self._range(e)
            f = self.facts.get(e)
            if f is not None:
                r = (max(r[0], f[0]), min(r[1], f[1]))
            self.rmemo[e] = r
        return r

    def _range(self, e: Expr) -> tuple:
        if isinstance(e, Const): return (e.value, e.value)
        if isinstance(e, Select):
            (a0, a1), (b0, b1) = self.range(e.a), self.range(e.b)
            return (min(a0, b0), max(a1, b1))
        if not isinstance(e, BinOp): return (-INF, INF)
        if e.op in _COMPARE or e.op in ("and", "or"): return (0, 1)
        (a0, a1), (b0, b1) = self.range(e.a), self.range(e.b)
        if e.op == "add": return (a0 + b0, a1 + b1)
        if e.op == "sub": return (a0 - b1, a1 - b0)
        if e.op == "mul":
            ps = [_mul(x, y) for x in (a0, a1) for y in (b0, b1)]
            return (min(ps), max(ps))
        if e.op == "min": return (min(a0, b0), min(a1, b1))
        if e.op == "max": return (max(a0, b0), max(a1, b1))
        if isinstance(e.b, Const) and e.b.value > 0:
            k = e.b.value
            if e.op == "floordiv": return (_fdiv(a0, k), _fdiv(a1, k))
            if _fdiv(a0, k) == _fdiv(a1, k) != INF and a0 != -INF:
                return (a0 - _fdiv(a0, k) * k, a1 - _fdiv(a0, k) * k)
            return (0, k - 1)
        return (-INF, INF)

    # ---- linear forms -----------------------------------------------------------------------
    def lin(self, e: Expr) -> Lin:
        r = self.lmemo.get(e)
        if r is None:
            r = self._lin(e)
            self.lmemo[e] = r
        return r

    def _lin(self, e: Expr) -> Lin:
        if isinstance(e, Const): return ({}, e.value)
        if isinstance(e, BinOp):
            if e.op in ("add", "sub"):
                return _combine(self.lin(e.a), self.lin(e.b), 1 if e.op == "add" else -1)
            if e.op == "mul" and isinstance(e.b, Const): return _scale(self.lin(e.a), e.b.value)
            if e.op == "mul" and isinstance(e.a, Const): return _scale(self.lin(e.b), e.a.value)
        return ({e: 1}, 0)

    def lin_range(self, terms: dict, c0: int) -> tuple:
        lo = hi = c0
        for t, c in terms.items():
            a, b = self.range(t)
            lo, hi = lo + min(_mul(a, c), _mul(b, c)), hi + max(_mul(a, c), _mul(b, c))
        return (lo, hi)

    def build(self, terms: dict, c0: int) -> Expr:
        """A sum from its linear form: positive terms first, then the subtracted ones."""
        order = sorted(((t, c) for t, c in terms.items() if c), key=lambda tc: (tc[1] < 0, _key(tc[0])))
        acc = None
        for t, c in order:
            if acc is None:
                acc = t if c == 1 else BinOp("mul", t, Const(c))
            elif c > 0:
                acc = BinOp("add", acc, t if c == 1 else BinOp("mul", t, Const(c)))
            else:
                acc = BinOp("sub", acc, t if c == -1 else BinOp("mul", t, Const(-c)))
        if acc is None: return Const(c0)
        return BinOp("add", acc, Const(c0)) if c0 else acc

    # ---- rewriting --------------------------------------------------------------------------
    def simp(self, e: Expr) -> Expr:
        r = self.memo.get(e)
        if r is None:
            r = self._simp(e)
            lo, hi = self.range(r)
            if lo == hi and not isinstance(r, Const):
                r = Const(int(lo))
            self.memo[e] = r
        return r

    def _simp(self, e: Expr) -> Expr:
        if isinstance(e, Load): return Load(e.buffer, self.simp(e.index))
        if isinstance(e, Select): return self._select(e)
        if not isinstance(e, BinOp): return e       # Const, Var, a renderer's raw fragment
        if e.op in ("and", "or"): return self._logic(e)
        a, b = self.simp(e.a), self.simp(e.b)
        if e.op in ("add", "sub"):
            return self.build(*_combine(self.lin(a), self.lin(b), 1 if e.op == "add" else -1))
        if e.op == "mul":
            if isinstance(a, Const) or isinstance(b, Const):
                k, x = (a.value, b) if isinstance(a, Const) else (b.value, a)
                return self.build(*_scale(self.lin(x), k))
            return BinOp("mul", *sorted((a, b), key=_key))
        if e.op in ("floordiv", "mod"):
            if isinstance(b, Const) and b.value > 0:
                return self._div(a, b.value) if e.op == "floordiv" else self._mod(a, b.value)
            if isinstance(a, Const) and isinstance(b, Const) and b.value != 0:
                return Const(a.value // b.value if e.op == "floordiv" else a.value % b.value)
            return BinOp(e.op, a, b if not isinstance(b, Const) or b.value else e.b)  # x/0 keeps its form
        if e.op in _COMPARE: return self._compare(e.op, a, b)
        if e.op in ("min", "max"):
            (a0, a1), (b0, b1) = self.range(a), self.range(b)
            if a1 <= b0: return a if e.op == "min" else b
            if b1 <= a0: return b if e.op == "min" else a
            if isinstance(a, Const) and isinstance(b, Const):
                return Const(min(a.value, b.value) if e.op == "min" else max(a.value, b.value))
        return BinOp(e.op, a, b)

    def _div(self, x: Expr, k: int) -> Expr:
        terms, c0 = self.lin(x)
        q0, r0 = divmod(c0, k)
        out = {t: c // k for t, c in terms.items() if c % k == 0}
        rest = {t: c for t, c in terms.items() if c % k}
        lo, hi = self.lin_range(rest, r0)
        if _fdiv(lo, k) == _fdiv(hi, k) != INF and lo != -INF:
            return self.build(out, q0 + _fdiv(lo, k))
        inner = None
        split = self._split(rest, r0, k)
        if split is not None:                     # floordiv(d*a + b, d*m) = floordiv(a + q, m)
            (a_terms, a0), d = split
            inner = self._div(self.build(a_terms, a0), k // d)
        elif len(rest) == 1:
            (t, c), = rest.items()
            if c == 1 and isinstance(t, BinOp) and t.op == "floordiv" and isinstance(t.b, Const) and t.b.value > 0:
                a = t.b.value                     # floordiv(floordiv(y, a) + r, k) = floordiv(y + r*a, a*k)
                inner = self._div(self.simp(BinOp("add", t.a, Const(r0 * a))), a * k)
        if inner is None:
            inner = BinOp("floordiv", self.build(rest, r0), Const(k))
        return self.build(*_combine((out, q0), self.lin(inner), 1))

    def _mod(self, x: Expr, k: int) -> Expr:
        terms, c0 = self.lin(x)
        for _ in range(8):                         # c*mod(y, m) == c*y (mod k) when k | c*m
            rest = {t: c for t, c in terms.items() if c % k}
            inner = [(t, c) for t, c in rest.items() if isinstance(t, BinOp) and t.op == "mod"
                     and isinstance(t.b, Const) and t.b.value > 0 and (c * t.b.value) % k == 0]
            if not inner:
                break
            terms = {t: c for t, c in rest.items() if t not in dict(inner)}
            for t, c in inner:
                terms = _combine((terms, 0), _scale(self.lin(t.a), c), 1)[0]
                c0 += self.lin(t.a)[1] * c
        terms = {t: c for t, c in terms.items() if c % k}
        r0 = c0 % k                                # (coefficients stay: reducing them can widen the range)
        lo, hi = self.lin_range(terms, r0)
        if _fdiv(lo, k) == _fdiv(hi, k) != INF and lo != -INF:
            return self.build(terms, r0 - _fdiv(lo, k) * k)
        split = self._split(terms, r0, k)
        if split is not None:                      # mod(d*a + b, d*m) = d*mod(a + q, m) + b - d*q
            (a_terms, a0), d = split
            b_terms = {t: c for t, c in terms.items() if c % d}
            inner = self._mod(self.build(a_terms, a0), k // d)      # a0 is q
            return self.build(*_combine(_scale(self.lin(inner), d), (b_terms, r0 - d * a0), 1))
        return BinOp("mod", self.build(terms, r0), Const(k))

    def _split(self, terms: dict, c0: int, k: int):
        """((terms of a, q), d): d | k, terms = d*a + b with b (the terms whose coefficient d does
        not divide, plus c0) in [d*q, d*q + d); the largest such d; None when there is none."""
        for d in sorted({math.gcd(c, k) for c in terms.values()} - {1, k}, reverse=True):
            b_terms = {t: c for t, c in terms.items() if c % d}
            lo, hi = self.lin_range(b_terms, c0)
            if lo == -INF or hi == INF or _fdiv(lo, d) != _fdiv(hi, d):
                continue
            a_terms = {t: c // d for t, c in terms.items() if c % d == 0}
            return (a_terms, _fdiv(lo, d)), d
        return None

    def _compare(self, op: str, a: Expr, b: Expr) -> Expr:
        terms, c0 = _combine(self.lin(a), self.lin(b), -1)       # a - b  (op)  0
        lo, hi = self.lin_range(terms, c0)
        decided = {"lt": (hi < 0, lo >= 0), "le": (hi <= 0, lo > 0),
                   "eq": (lo == hi == 0, lo > 0 or hi < 0), "ne": (lo > 0 or hi < 0, lo == hi == 0)}[op]
        if decided[0]: return Const(1)
        if decided[1]: return Const(0)
        g = math.gcd(*terms.values()) if terms else 1
        if op in ("eq", "ne") and c0 % g:
            return Const(int(op == "ne"))
        if op == "lt":                              # g*p + c0 < 0  <=>  p <= floor((-c0 - 1) / g)
            op, c = "le", (-c0 - 1) // g
        else:
            c = (-c0) // g if op == "le" else -c0 // g
        p = {t: v // g for t, v in terms.items()}
        if op == "le":
            p, c = self._peel_compare(p, c)
        if sum(v < 0 for v in p.values()) > sum(v > 0 for v in p.values()):
            p, c = {t: -v for t, v in p.items()}, -c
            if op == "le":                           # p <= c  <=>  -c <= -p
                return BinOp("le", Const(c), self.build(p, 0))
        if op == "le":                               # p <= c  <=>  p < c + 1
            return BinOp("lt", self.build(p, 0), Const(c + 1))
        return BinOp(op, self.build(p, 0), Const(c))

    def _peel_compare(self, p: dict, c: int) -> tuple[dict, int]:
        """p <= c with p = d*a + b, b in [lo, hi] and floor((c - b) / d) one value m: a <= m;
        floordiv(x, k) <= c: x <= c*k + k - 1 (and -floordiv(x, k) <= c: -x <= c*k)."""
        for d in sorted({abs(v) for v in p.values()} - {1}, reverse=True):
            b_terms = {t: v for t, v in p.items() if v % d}
            lo, hi = self.lin_range(b_terms, 0)
            if lo != -INF and hi != INF and (c - lo) // d == (c - hi) // d:
                a_terms = {t: v // d for t, v in p.items() if v % d == 0}
                return self._peel_compare(a_terms, (c - lo) // d)
        if len(p) == 1:
            (t, v), = p.items()
            if abs(v) == 1 and isinstance(t, BinOp) and t.op == "floordiv" and isinstance(t.b, Const) and t.b.value > 0:
                k = t.b.value
                x_terms, x0 = _scale(self.lin(t.a), v)
                return self._peel_compare(x_terms, (c * k + k - 1 if v > 0 else c * k) - x0)
        return p, c

    def _logic(self, e: BinOp) -> Expr:
        if e.op == "and":
            return self._conjunction(e)
        a = self.simp(e.a)
        conj = e.op == "and"
        if isinstance(a, Const):
            if bool(a.value) != conj:
                return Const(int(bool(a.value)))     # 0 && x -> 0, 1 || x -> 1
            b = self.simp(e.b)
            return b if _boolean(self, b) else BinOp("ne", b, Const(0))
        b = self.under(a, conj).simp(e.b)            # b is evaluated only where a decides nothing
        if isinstance(b, Const):
            if bool(b.value) != conj:
                return Const(int(bool(b.value)))
            return a if _boolean(self, a) else BinOp("ne", a, Const(0))
        return BinOp(e.op, a, b)

    def _conjunction(self, e: BinOp) -> Expr:
        """c1 && c2 && ...: each term under the facts of those before it (C evaluates it only
        there) and, when it reads no buffer, of the one-variable comparisons after it too (where one
        of those fails the whole is false either way; a load could move out of bounds)."""
        terms, stack = [], [e]
        while stack:
            x = stack.pop()
            if isinstance(x, BinOp) and x.op == "and":
                stack += [x.b, x.a]
            else:
                terms.append(x)
        plain = [self.simp(t) for t in terms]
        facts = [p for p in plain if self._fact(p)]
        later = self
        for p in facts:
            later = later.under(p, True)
        out, ctx = [], self
        for t, p in zip(terms, plain):
            if not (isinstance(p, Const) or self._fact(p)):
                p = (ctx if loads(t) else _Simplifier(_narrow(later.facts, ctx.facts))).simp(t)
            if isinstance(p, Const):
                if not p.value: return Const(0)
                continue
            if p not in out:
                out.append(p)
                ctx = ctx.under(p, True)
        for p in [p for p in out if self._fact(p)]:   # drop a bound the other bounds imply
            rest = self
            for q in out:
                if q is not p and self._fact(q):
                    rest = rest.under(q, True)
            if rest is not self and rest.simp(p) == Const(1):
                out.remove(p)
        if not out: return Const(1)
        if len(out) == 1: return out[0] if _boolean(self, out[0]) else BinOp("ne", out[0], Const(0))
        acc = out[0]
        for p in out[1:]:
            acc = BinOp("and", acc, p)
        return acc

    def _fact(self, p: Expr) -> bool:
        """A comparison of one variable with a constant (it narrows the variable's range)."""
        if not (isinstance(p, BinOp) and p.op in ("lt", "le", "eq")): return False
        terms = _combine(self.lin(p.a), self.lin(p.b), -1)[0]
        return len(terms) == 1 and isinstance(next(iter(terms)), Var)

    def _select(self, e: Select) -> Expr:
        c = self.simp(e.cond)
        if isinstance(c, Const):
            return self.simp(e.a if c.value else e.b)
        a, b = self.under(c, True).simp(e.a), self.under(c, False).simp(e.b)
        return a if a == b else Select(c, a, b)

    def under(self, cond: Expr, holds: bool) -> "_Simplifier":
        """A simplifier that also knows the facts of `cond` being true (holds) or false."""
        facts = dict(self.facts)
        self._learn(cond, holds, facts)
        return self if facts == self.facts else _Simplifier(facts)

    def _learn(self, cond: Expr, holds: bool, facts: dict) -> None:
        if not isinstance(cond, BinOp): return
        if cond.op == ("and" if holds else "or"):
            self._learn(cond.a, holds, facts)
            self._learn(cond.b, holds, facts)
            return
        if cond.op not in _COMPARE: return
        terms, c0 = _combine(self.lin(cond.a), self.lin(cond.b), -1)  # d = a - b
        if len(terms) != 1: return
        (t, c), = terms.items()
        op = cond.op if holds else {"lt": "ge", "le": "gt", "eq": "ne", "ne": "eq"}[cond.op]
        if op == "ne": return
        lo, hi = -INF, INF                          # c*t + c0  (op)  0
        if op in ("lt", "le", "eq"):                # c*t <= m
            m = -c0 - 1 if op == "lt" else -c0
            if c > 0: hi = m // c
            else: lo = -((-m) // c)
        if op in ("ge", "gt", "eq"):                # c*t >= m
            m = -c0 + 1 if op == "gt" else -c0
            if c > 0: lo = -((-m) // c)
            else: hi = (-m) // (-c)
        old = facts.get(t, (-INF, INF))
        facts[t] = (max(old[0], lo), min(old[1], hi))


def _narrow(a: dict, b: dict) -> dict:
    """Facts of both: each term's ranges intersected."""
    out = dict(a)
    for t, (lo, hi) in b.items():
        o = out.get(t, (-INF, INF))
        out[t] = (max(o[0], lo), min(o[1], hi))
    return out


def _boolean(s: _Simplifier, e: Expr) -> bool:
    lo, hi = s.range(e)
    return lo >= 0 and hi <= 1


def _combine(x: Lin, y: Lin, sign: int) -> Lin:
    terms = dict(x[0])
    for t, c in y[0].items():
        v = terms.get(t, 0) + sign * c
        if v: terms[t] = v
        else: terms.pop(t, None)
    return terms, x[1] + sign * y[1]


def _scale(x: Lin, k: int) -> Lin:
    if k == 0: return ({}, 0)
    return {t: c * k for t, c in x[0].items()}, x[1] * k


def _mul(x, y):
    return 0 if x == 0 or y == 0 else x * y     # 0 * inf is 0 here (an exact zero factor)


def _fdiv(x, k: int):
    return x if x in (INF, -INF) else x // k


def _key(e: Expr):
    """Deterministic term order: u, i, j, other variables, then shallower terms, then by text."""
    if isinstance(e, Var): return (0, _VAR_ORDER.get(e.name, 9), e.name)
    return (1 + _depth(e), 0, repr(e))


_VAR_ORDER = {"u": 0, "i": 1, "ri": 2, "j": 3}


def _depth(e: Expr) -> int:
    if isinstance(e, BinOp): return 1 + max(_depth(e.a), _depth(e.b))
    if isinstance(e, Select): return 1 + max(_depth(e.cond), _depth(e.a), _depth(e.b))
    if isinstance(e, Load): return 1 + _depth(e.index)
    return 0


def _magnitude(s: _Simplifier, e: Expr, seen: dict | None = None) -> float:
    """The largest |value| any node of `e` can take (the widest intermediate of its C form).
    A subexpression met again is looked at once (`seen`, by identity): composed index maps
    share subexpressions, and walking them as a tree took 5 million calls for Swin-T's kernels."""
    seen = {} if seen is None else seen
    hit = seen.get(id(e))
    if hit is not None:
        return hit
    lo, hi = s.range(e)
    m = max(abs(lo), abs(hi))
    if isinstance(e, BinOp):
        m = max(m, _magnitude(s, e.a, seen), _magnitude(s, e.b, seen))
    elif isinstance(e, Select):
        m = max(m, _magnitude(s, e.cond, seen), _magnitude(s, e.a, seen), _magnitude(s, e.b, seen))
    elif isinstance(e, Load):
        m = max(m, _magnitude(s, e.index, seen))
    seen[id(e)] = m
    return m
