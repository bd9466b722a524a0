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


@pytest.mark.parametrize("pred", [Load("idx", U).lt(3), (U * J).lt(100), (J // (U + 1)).lt(2)],
                         ids=["load", "product", "divisor"])
def test_outside_the_fragment_every_unit_is_checked(pred):
    assert deciding_units(np.arange(10000), [pred], 2, 8) is None


def test_units_that_are_not_one_run_are_checked_every_one():
    units = np.concatenate([np.arange(5000), np.arange(6000, 11000)])
    assert deciding_units(units, [(U % 7).lt(3)], 2, 8) is None
    assert deciding_units(np.arange(5000), [(U % 7).lt(3)], 2, 8) is not None


def test_atoms_in_u_alone_need_no_period():
    # DenseNet's concat: a writer's channel range ((u // 56) % 96 < 64, period 5376 = every unit)
    # beside its unit range and element masks in i, j: a few units decide, not all 5376
    ch = (U // 56) % 96
    preds = [(I * 128 + J).lt(56), binop("le", U, 3583), binop("and", binop("le", 0, ch), ch.lt(64)),
             binop("le", 3584, U), binop("and", binop("le", 64, ch), ch.lt(96))]
    sub = _assert_decides(preds, np.arange(5376), 1, 128)
    assert len(sub) <= 8


def test_a_unit_alone_condition_met_at_one_unit_is_kept():
    # u-only atoms outside the quasi-periodic fragment (a product) are evaluated at every unit
    preds = [(U * U).eq(2500), (U % 7 + I).lt(3)]
    sub = _assert_decides(preds, np.arange(3000), 2, 4)
    assert 50 in sub.tolist()


def test_random_predicates_with_unit_alone_atoms():
    rng = np.random.default_rng(11)

    def unit_expr():
        return [lambda: (U * U) // int(rng.integers(1, 50)), lambda: (U // int(rng.integers(1, 40))) % int(rng.integers(2, 9)),
                lambda: U * int(rng.integers(-3, 4)) + int(rng.integers(-50, 50))][rng.integers(3)]()

    def mixed_expr():
        return (U * int(rng.integers(1, 4)) + I * int(rng.integers(-2, 3)) + J) // int(rng.integers(1, 6)) % int(rng.integers(2, 7))

    decided = 0
    for _ in range(300):
        preds = [binop(("lt", "le", "eq", "ne")[rng.integers(4)], unit_expr(), int(rng.integers(0, 60)))
                 for _ in range(rng.integers(1, 3))]
        preds += [binop(("lt", "le", "eq")[rng.integers(3)], mixed_expr(), int(rng.integers(0, 4)))
                  for _ in range(rng.integers(0, 2))]
        n = int(rng.integers(50, 2000))
        units, num, width = np.arange(3, 3 + n), int(rng.integers(1, 3)), int(rng.integers(1, 5))
        if deciding_units(units, preds, num, width) is not None:
            _assert_decides(preds, units, num, width)
            decided += 1
    assert decided > 100
