"""Index expressions: the affine-with-div/mod language of slice offsets.

An `Expr` is an immutable tree over the variables `u` (parallel unit index),
`i` (segment index, < num) and `j` (element index in a segment, < width), integer
constants, + - * // % min max, comparisons, `select`, and `load` (a value read from a
global buffer, for gather). Expressions are built with Python operators, evaluated
vectorised with numpy (the interpreter, the sync-scope analysis) and rendered to C
(the backends). Construction folds constants and the trivial identities, so equal
patterns built twice compare equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Mapping

import numpy as np

_C_BINOPS = {"add": "+", "sub": "-", "mul": "*", "floordiv": "/", "mod": "%",
             "lt": "<", "le": "<=", "eq": "==", "ne": "!=", "and": "&&", "or": "||"}
_NP_BINOPS: dict[str, Callable] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "floordiv": np.floor_divide,
    "mod": np.mod, "min": np.minimum, "max": np.maximum, "lt": np.less, "le": np.less_equal,
    "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
}
_PY_BINOPS: dict[str, Callable] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "min": min, "max": max,
    "lt": lambda a, b: int(a < b), "le": lambda a, b: int(a <= b), "eq": lambda a, b: int(a == b),
    "ne": lambda a, b: int(a != b), "and": lambda a, b: int(bool(a) and bool(b)),
    "or": lambda a, b: int(bool(a) or bool(b)),
}


class Expr:
    """Base of the expression nodes; operators build new nodes."""
    __slots__ = ()

    def __add__(self, o): return binop("add", self, o)
    def __radd__(self, o): return binop("add", o, self)
    def __sub__(self, o): return binop("sub", self, o)
    def __rsub__(self, o): return binop("sub", o, self)
    def __mul__(self, o): return binop("mul", self, o)
    def __rmul__(self, o): return binop("mul", o, self)
    def __floordiv__(self, o): return binop("floordiv", self, o)
    def __mod__(self, o): return binop("mod", self, o)
    def lt(self, o): return binop("lt", self, o)
    def le(self, o): return binop("le", self, o)
    def ge(self, o): return binop("le", o, self)
    def eq(self, o): return binop("eq", self, o)
    def __and__(self, o): return binop("and", self, o)
    def __or__(self, o): return binop("or", self, o)


@dataclass(frozen=True, slots=True)
class Const(Expr):
    value: int

    def __repr__(self): return str(self.value)


@dataclass(frozen=True, slots=True)
class Var(Expr):
    name: str  # "u" | "i" | "j"

    def __repr__(self): return self.name


# Compound nodes keep their hash once computed: composed index maps are trees of thousands of
# nodes, and the dataclass hash walked the whole tree at every dict or lru_cache lookup. The
# value is the dataclass hash (the same number, so set and dict orders do not change); it is
# not pickled (`__reduce__`), since string hashes differ between processes.
_NO_HASH = field(default=None, init=False, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class BinOp(Expr):
    op: str
    a: Expr
    b: Expr
    _hash: int | None = _NO_HASH

    def __hash__(self):
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.op, self.a, self.b)))
        return self._hash

    def __reduce__(self): return (BinOp, (self.op, self.a, self.b))

    def __repr__(self):
        sym = _C_BINOPS.get(self.op)
        return f"({self.a!r} {sym} {self.b!r})" if sym else f"{self.op}({self.a!r}, {self.b!r})"


@dataclass(frozen=True, slots=True)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr
    _hash: int | None = _NO_HASH

    def __hash__(self):
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.cond, self.a, self.b)))
        return self._hash

    def __reduce__(self): return (Select, (self.cond, self.a, self.b))

    def __repr__(self): return f"({self.cond!r} ? {self.a!r} : {self.b!r})"


@dataclass(frozen=True, slots=True)
class Load(Expr):
    """The integer stored at `buffer[index]` (a global buffer: gather indices)."""
    buffer: str
    index: Expr
    _hash: int | None = _NO_HASH

    def __hash__(self):
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.buffer, self.index)))
        return self._hash

    def __reduce__(self): return (Load, (self.buffer, self.index))

    def __repr__(self): return f"{self.buffer}[{self.index!r}]"


U, I, J = Var("u"), Var("i"), Var("j")
ZERO, ONE = Const(0), Const(1)


def const(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (bool, np.bool_)):
        return Const(int(x))
    if isinstance(x, (int, np.integer)):
        return Const(int(x))
    raise TypeError(f"not an index expression: {x!r}")


def binop(op: str, a, b) -> Expr:
    a, b = const(a), const(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(_PY_BINOPS[op](a.value, b.value))
    if op == "add":
        if a == ZERO: return b
        if b == ZERO: return a
        if isinstance(a, Const): a, b = b, a  # constants to the right
        if isinstance(b, Const) and isinstance(a, BinOp) and a.op == "add" and isinstance(a.b, Const):
            return binop("add", a.a, a.b.value + b.value)
    elif op == "sub":
        if b == ZERO: return a
        if isinstance(b, Const): return binop("add", a, -b.value)
        if a == b: return ZERO
    elif op == "mul":
        if a == ZERO or b == ZERO: return ZERO
        if a == ONE: return b
        if b == ONE: return a
        if isinstance(a, Const): a, b = b, a
        if isinstance(b, Const) and isinstance(a, BinOp) and a.op == "mul" and isinstance(a.b, Const):
            return binop("mul", a.a, a.b.value * b.value)
    elif op == "floordiv":
        if b == ONE: return a
    elif op == "mod":
        if b == ONE: return ZERO
    return _shared(BinOp, op, a, b)


def select(cond, a, b) -> Expr:
    cond, a, b = const(cond), const(a), const(b)
    if isinstance(cond, Const):
        return a if cond.value else b
    if a == b:
        return a
    return _shared(Select, cond, a, b)


def _shared(cls, *parts):
    """The node `cls(*parts)`, the same object as an equal node built before (while the table
    holds it): substitution and composition rebuild the same subexpressions again and again,
    and shared objects let evaluation, hashing and the simplifier's memos meet each once.
    Equality is structural either way; sharing only saves work."""
    key = (cls, *map(_part_key, parts))
    hit = _SHARED.get(key)
    if hit is None:
        if len(_SHARED) >= 1 << 18:
            _SHARED.clear()
        hit = _SHARED[key] = cls(*parts)
    return hit


def shared_node(cls, *parts) -> Expr:
    """`cls(*parts)` for a compound node class (BinOp, Select, Load), exactly as given (no
    folding), shared like the nodes `binop` builds: for readers that rebuild trees (the plan
    cache's decoding and renaming)."""
    if cls not in (BinOp, Select, Load):
        raise TypeError(f"not a compound index expression class: {cls}")
    return _shared(cls, *parts)


def _part_key(p):
    """Leaves and strings by value, subexpressions by identity (the table's node holds them, so
    their ids stay theirs while the entry lives)."""
    if isinstance(p, Const): return ("c", type(p.value), p.value)   # Const(True) renders unlike Const(1)
    if isinstance(p, Var): return ("v", p.name)
    if isinstance(p, str): return p
    return id(p)


_SHARED: dict[tuple, Expr] = {}


def emin(a, b) -> Expr: return binop("min", a, b)
def emax(a, b) -> Expr: return binop("max", a, b)


@lru_cache(maxsize=1 << 16)
def variables(e: Expr) -> frozenset[str]:
    if isinstance(e, Var): return frozenset({e.name})
    if isinstance(e, Const): return frozenset()
    if isinstance(e, BinOp): return variables(e.a) | variables(e.b)
    if isinstance(e, Select): return variables(e.cond) | variables(e.a) | variables(e.b)
    if isinstance(e, Load): return variables(e.index)
    raise TypeError(e)


@lru_cache(maxsize=1 << 16)
def loads(e: Expr) -> frozenset[str]:
    """Buffers an expression reads (gather indices)."""
    if isinstance(e, (Var, Const)): return frozenset()
    if isinstance(e, BinOp): return loads(e.a) | loads(e.b)
    if isinstance(e, Select): return loads(e.cond) | loads(e.a) | loads(e.b)
    if isinstance(e, Load): return frozenset({e.buffer}) | loads(e.index)
    raise TypeError(e)


def substitute(e: Expr, mapping: Mapping[str, Expr], seen: dict | None = None) -> Expr:
    """Replace variables by expressions (rebuilding, so constants fold again). A node object
    met again in the tree is rebuilt once (composition shares subexpressions: walking the
    tree as written grows exponentially with the depth of composition)."""
    if isinstance(e, Var): return mapping.get(e.name, e)
    if isinstance(e, Const): return e
    seen = {} if seen is None else seen
    hit = seen.get(id(e))
    if hit is not None:
        return hit[1]
    if isinstance(e, BinOp):
        out = binop(e.op, substitute(e.a, mapping, seen), substitute(e.b, mapping, seen))
    elif isinstance(e, Select):
        out = select(substitute(e.cond, mapping, seen), substitute(e.a, mapping, seen),
                     substitute(e.b, mapping, seen))
    elif isinstance(e, Load):
        out = Load(e.buffer, substitute(e.index, mapping, seen))
    else:
        raise TypeError(e)
    seen[id(e)] = (e, out)   # held with its result, so its id stays its own
    return out


def evaluate(e: Expr, env: Mapping[str, np.ndarray | int], buffers: Mapping[str, np.ndarray] | None = None,
             seen: dict | None = None):
    """Vectorised evaluation: variables bound to broadcastable int64 arrays. A node object that
    occurs several times in the tree is evaluated once per call: composed index maps repeat
    the same subexpressions many times over (a Swin window shift's tree of 6000 nodes has under
    100 distinct ones), and `binop`/`select` hand back one shared object for equal nodes.
    `seen`: a memo the caller keeps across calls with the same `env` and `buffers` (expressions
    built from one another share nodes); the arrays it holds must not be written to."""
    return _value(e, env, buffers, {} if seen is None else seen)


def _value(e: Expr, env, buffers, seen: dict):
    kind = type(e)   # exact types: the node classes have no subclasses that evaluate
    if kind is Const: return np.int64(e.value)
    if kind is Var: return env[e.name]
    hit = seen.get(id(e))
    if hit is not None:
        return hit[1]
    if kind is BinOp:
        out = _binop_values(e.op, _value(e.a, env, buffers, seen), _value(e.b, env, buffers, seen))
    elif kind is Select:
        out = np.where(_value(e.cond, env, buffers, seen), _value(e.a, env, buffers, seen),
                       _value(e.b, env, buffers, seen))
    elif kind is Load:
        if buffers is None or e.buffer not in buffers:
            raise KeyError(f"expression loads from '{e.buffer}', which is not available")
        data = buffers[e.buffer].reshape(-1)
        out = data[np.clip(_value(e.index, env, buffers, seen), 0, data.size - 1)].astype(np.int64)
    else:
        raise TypeError(e)
    seen[id(e)] = (e, out)   # the node is held with its value, so its id stays its own
    return out


def _binop_values(op: str, a, b):
    # called once per distinct node of every evaluation (a million times in a Swin-T search):
    # the common case, integer operands, goes straight to the ufunc
    if op in _ARITH:   # a comparison is 0 or 1 in arithmetic, as in C (numpy: True + True is True)
        if op in _DIVIDING and type(b) is np.ndarray:
            b = np.where(b == 0, 1, b)
        a, b = _as_int(a), _as_int(b)
    return _NP_BINOPS[op](a, b)


_ARITH = frozenset(("add", "sub", "mul", "floordiv", "mod", "min", "max"))
_DIVIDING = frozenset(("floordiv", "mod"))


def _as_int(x):
    kind = type(x)
    if kind is np.ndarray:
        return x.astype(np.int64) if x.dtype == np.bool_ else x
    return np.int64(x) if kind is bool or kind is np.bool_ else x


def render_c(e: Expr, names: Mapping[str, str] | None = None, load: Callable[[str, str], str] | None = None,
             floor: Callable[[str, str, str], str] | None = None) -> str:
    """C source for an expression. C's / and % truncate, GIR's // and % floor: they agree on
    non-negative operands; `floor(op, a, b)` renders floordiv/mod where operands may be negative.
    `names` maps variables to C identifiers; `load(buffer, index_src)` renders a Load."""
    names = names or {}
    if hasattr(e, "text"): return e.text  # a renderer's raw C fragment
    if isinstance(e, Const): return str(e.value)
    if isinstance(e, Var): return names.get(e.name, e.name)
    if isinstance(e, BinOp):
        a, b = render_c(e.a, names, load, floor), render_c(e.b, names, load, floor)
        if floor is not None and e.op in ("floordiv", "mod"):
            return floor(e.op, a, b)
        if e.op in _C_BINOPS:
            return f"({a} {_C_BINOPS[e.op]} {b})"
        return f"{e.op}({a}, {b})"
    if isinstance(e, Select):
        return (f"({render_c(e.cond, names, load, floor)} ? {render_c(e.a, names, load, floor)} : "
                f"{render_c(e.b, names, load, floor)})")
    if isinstance(e, Load):
        idx = render_c(e.index, names, load, floor)
        return load(e.buffer, idx) if load else f"((long long){e.buffer}[{idx}])"
    raise TypeError(e)


def affine_coefficient(e: Expr, var: str) -> int | None:
    """If `e` is affine in `var` (other variables arbitrary but not mixed with it),
    its coefficient; None when `e` is not affine in `var`. Used to find contiguous
    (coefficient 1 in j) and strided (coefficient in i) accesses."""
    if var not in variables(e):
        return 0
    if isinstance(e, Var):
        return 1
    if isinstance(e, BinOp):
        ca, cb = affine_coefficient(e.a, var), affine_coefficient(e.b, var)
        if ca is None or cb is None:
            return None
        if e.op == "add": return ca + cb
        if e.op == "sub": return ca - cb
        if e.op == "mul":
            if isinstance(e.b, Const): return ca * e.b.value
            if isinstance(e.a, Const): return cb * e.a.value
    return None
