"""Index expressions share equal nodes and evaluate each shared one once: the values are those
of the tree as written (checked against plain Python on every element)."""
from __future__ import annotations

import operator
import pickle

import numpy as np

from powerfusion.gir.expr import BinOp, Const, I, J, U, evaluate, select, substitute


def _composed(depth: int):
    """A reshape-through-transpose map composed `depth` times: each level uses the one below
    three times, so the tree as written grows as 3^depth while its distinct nodes grow linearly."""
    e = U * 12 + I * 4 + J
    for _ in range(depth):
        e = substitute(e, {"u": e // 7 % 5, "i": e // 3 % 4, "j": e % 3})
    return e


def _python(e, u: int, i: int, j: int, seen=None) -> int:
    """The value at one element, node by node in plain Python (shared nodes once)."""
    seen = {} if seen is None else seen
    if isinstance(e, Const):
        return e.value
    if not isinstance(e, BinOp):
        return {"u": u, "i": i, "j": j}[e.name]
    if id(e) not in seen:
        a, b = _python(e.a, u, i, j, seen), _python(e.b, u, i, j, seen)
        seen[id(e)] = {"add": operator.add, "mul": operator.mul, "floordiv": operator.floordiv,
                       "mod": operator.mod}[e.op](a, b)
    return seen[id(e)]


def test_equal_nodes_are_one_object_and_keep_the_dataclass_hash():
    a, b = (U * 3 + I) // 4, (U * 3 + I) // 4
    assert a is b and hash(a) == hash((a.op, a.a, a.b))
    assert select(U.lt(2), a, J) is select(U.lt(2), b, J)
    assert pickle.loads(pickle.dumps(a)) == a   # the cached hash is not pickled


def test_a_composed_map_evaluates_to_its_values_as_written():
    e = _composed(5)
    env = {"u": np.arange(5)[:, None, None], "i": np.arange(4)[None, :, None], "j": np.arange(3)[None, None, :]}
    got = np.broadcast_to(evaluate(e, env), (5, 4, 3))
    want = np.array([[[_python(e, u, i, j) for j in range(3)] for i in range(4)] for u in range(5)])
    assert np.array_equal(got, want)
