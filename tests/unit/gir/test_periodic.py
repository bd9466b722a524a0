"""deciding_units (gir/periodic.py): the units it keeps show every truth pattern that any unit
shows, so an exact check over them is an exact check over all units."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.gir.expr import I, J, U, Const, Load, binop, evaluate, select
from powerfusion.gir.periodic import deciding_units, shape


def _patterns(preds, units, num, width) -> list[bytes]:
    env = {"u": np.asarray(units)[:, None, None], "i": np.arange(num)[None, :, None], "j": np.arange(width)[None, None, :]}
    vals = [np.broadcast_to(evaluate(p, env), (len(units), num, width)).astype(bool).reshape(len(units), -1) for p in preds]
    return [row.tobytes() for row in np.concatenate(vals, axis=1)]


def _assert_decides(preds, units, num, width):
    sub = deciding_units(units, preds, num, width)
    assert sub is not None
    assert set(sub.tolist()) <= set(units.tolist()) and len(sub) * 4 <= len(units)
    everyone = _patterns(preds, units, num, width)
    kept = set(_patterns(preds, sub, num, width))
    missing = [int(u) for u, p in zip(units, everyone) if p not in kept]
    assert not missing, f"units {missing[:5]} show a case none of the deciding units shows"
    return sub


def test_period_and_slope_of_a_window_shift():
    e = ((U * 96 + J - 288) % 5376) // 96 + ((U * 96 + J - 288) // 5376) * 53   # a rolled row's writer unit
    assert shape(e) == (56, 53)
    u = np.arange(400)[:, None]
    v = np.broadcast_to(evaluate(e, {"u": u, "i": np.int64(0), "j": np.arange(96)[None, :]}), (400, 96))
    assert np.array_equal(v[56:], v[:-56] + 53)


def test_a_case_met_at_one_unit_in_the_middle_is_kept():
    # a condition against the same one off by one: they differ only where the writer unit is 2900
    u1 = ((U * 96 + I * 32 + J - 288) % 5376) // 96 + ((U * 96 + I * 32 + J - 288) // 5376) * 53
    preds = [u1.lt(2900), u1.lt(2901), binop("le", 0, u1)]
    sub = _assert_decides(preds, np.arange(3136), 3, 32)
    env = {"u": np.arange(3136)[:, None, None], "i": np.arange(3)[None, :, None], "j": np.arange(32)[None, None, :]}
    odd = np.flatnonzero((np.broadcast_to(evaluate(u1, env), (3136, 3, 32)) == 2900).any(axis=(1, 2)))
    assert odd.size and np.isin(odd, sub).any()


def test_a_sign_that_steps_over_zero_between_blocks_starts_a_new_run():
    # a - b = 3 * (i // 4) - 2u + 1 is 1 at unit 0 and -1 at unit 1: never 0, yet the sign flips
    e = (((I // 4) - select(Const(-5).lt(I), U, U + 1)) * 3).lt((U + 1) * -1)
    _assert_decides([e], np.arange(487), 3, 2)


def test_random_quasi_affine_predicates():
    rng = np.random.default_rng(7)

    def expr(depth):
        if depth == 0:
            return [U, I, J, Const(int(rng.integers(-5, 6)))][rng.integers(4)]
        k, a = rng.integers(6), expr(depth - 1)
        return [lambda: a + expr(depth - 1), lambda: a * int(rng.integers(-3, 4)), lambda: a // int(rng.integers(1, 9)),
                lambda: a % int(rng.integers(1, 9)), lambda: a - expr(depth - 1),
                lambda: select(expr(depth - 1).lt(expr(depth - 1)), a, a + 1)][k]()

    decided = 0
    for _ in range(400):
        preds = [binop(("lt", "le", "eq", "ne")[rng.integers(4)], expr(3), expr(2)) for _ in range(rng.integers(1, 4))]
        base, n = int(rng.integers(0, 50)), int(rng.integers(20, 1500))
        units, num, width = np.arange(base, base + n), int(rng.integers(1, 4)), int(rng.integers(1, 6))
        if deciding_units(units, preds, num, width) is not None:
            _assert_decides(preds, units, num, width)
            decided += 1
    assert decided > 100   # most draws have a period short enough to gain


@pytest.mark.parametrize("pred", [Load("idx", U).lt(3), (U * U).lt(100), (J // (U + 1)).lt(2)],
                         ids=["load", "product", "divisor"])
def test_outside_the_fragment_every_unit_is_checked(pred):
    assert deciding_units(np.arange(10000), [pred], 2, 8) is None


def test_units_that_are_not_one_run_are_checked_every_one():
    units = np.concatenate([np.arange(5000), np.arange(6000, 11000)])
    assert deciding_units(units, [(U % 7).lt(3)], 2, 8) is None
    assert deciding_units(np.arange(5000), [(U % 7).lt(3)], 2, 8) is not None
