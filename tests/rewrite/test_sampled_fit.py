"""Index refits and writer checks on large slices look at a sample of units (patterns.py).
The sample must set each digit of u on its own: with a few random units the digits of
u % 64 come out correlated and a refit that is wrong on most units passed (the transposed K
of decode attention at KV 16384 read the wrong rows)."""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import I, J, U, evaluate
from powerfusion.gir.ir import Level, MemorySlice
from powerfusion.rewrite.patterns import SAMPLE_CAP, sampled_units, compact


def _everywhere(e, units, num, width):
    env = {"u": units[:, None, None], "i": np.arange(num)[None, :, None], "j": np.arange(width)[None, None, :]}
    return np.broadcast_to(evaluate(e, env), (len(units), num, width))


def test_refit_of_a_large_slice_holds_on_every_unit():
    units, num, width = np.arange(3072), 512, 32
    # the transposed K's address (17 nodes: refitted); the old sample fitted u % 64 as
    # u%2 + 3*(u/2%2) + 3*(u/4%2) + 8*(u/8%2) + ...
    index = ((U % 64) + (U // 64) * 1048576) + ((I * 32 + J) * 64)
    s = MemorySlice("k", Level.GLOBAL, index, num, width, "float32")
    assert len(units) * s.count > SAMPLE_CAP   # the sampled path
    got = compact(s, units)
    assert np.array_equal(_everywhere(got.index, units, num, width), _everywhere(index, units, num, width))


def test_sample_sets_each_digit_alone():
    units = np.arange(3072)
    picked = sampled_units(units, 16384, exprs=(U % 3248,))
    for bit in range(12):
        assert (1 << bit) in picked
    assert set(picked.tolist()) <= set(units.tolist())
