"""A writer's injectivity over every unit, decided from one period of units where the index is
quasi-periodic in u (patterns.injective_by_period), agrees with the check over every unit."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.gir.expr import I, J, U, binop
from powerfusion.gir.ir import Level, MemorySlice, Parallel
from powerfusion.rewrite import patterns
from powerfusion.rewrite.patterns import injective_by_period

F32 = "float32"
PAR = Parallel(4096, 4, 32)


def _every_unit(w: MemorySlice, units, upg: int = 4) -> bool:
    addr, m = w.addresses(units), w.mask(units)
    u = np.asarray(units, np.int64)[:, None]
    owner = u if w.level == Level.REGISTER else u // upg if w.level == Level.SHARED else 0
    vals = np.sort((addr + owner * (int(addr.max(initial=0)) + 1))[m])
    return not bool(np.any(vals[1:] == vals[:-1]))


# (index, valid, level, what the period argument says: True / False / None = undecided)
CASES = [
    # a batch of images: 64 units per image, image stride 64 * 8 * 16 (disjoint blocks)
    ((U // 64) * 8192 + (U % 64) * 128 + I * 16 + J, None, Level.GLOBAL, True),
    # a window partition inside an image (units shuffled within the image), still disjoint images
    ((U // 64) * 8192 + ((U % 64) % 8) * 1024 + ((U % 64) // 8) * 128 + I * 16 + J, None, Level.GLOBAL, True),
    # two units of each image write the same row: a duplicate inside block 0
    ((U // 64) * 8192 + ((U % 64) // 2) * 128 + I * 16 + J, None, Level.GLOBAL, False),
    # the same addresses every period (slope 0): block 1 repeats block 0
    ((U % 64) * 128 + I * 16 + J, None, Level.GLOBAL, False),
    # images interleaved (stride 1, smaller than an image's span) and no address repeats: undecided
    ((U // 64) + (U % 64) * 64 + I * 8 + J, binop("lt", J, 1), Level.GLOBAL, None),
    # blocks overlap and addresses do repeat: undecided here, a duplicate over every unit
    ((U // 64) * 512 + (U % 64) * 16 + I * 2 + J, binop("lt", J, 2), Level.GLOBAL, None),
    # a guard periodic in u (every other unit writes), stride of a full image
    ((U // 64) * 8192 + (U % 64) * 128 + I * 16 + J, binop("eq", U % 2, 0), Level.GLOBAL, True),
    # registers: each unit its own; a unit writing one slot twice repeats in every unit
    (I * 16 + J, None, Level.REGISTER, True),
    (I * 16 + J // 2, None, Level.REGISTER, False),
    # shared memory: each group of 4 units its own; units of a group write distinct rows, or not
    ((U % 4) * 128 + I * 16 + J, None, Level.SHARED, True),
    ((U % 2) * 128 + I * 16 + J, None, Level.SHARED, False),
]


@pytest.mark.parametrize("index,valid,level,expected", CASES)
def test_one_period_decides_like_every_unit(index, valid, level, expected):
    w = MemorySlice("T", level, index, 8, 16, F32, 1, valid)
    units = np.arange(0, 64 * 8, dtype=np.int64)
    got = injective_by_period(w, units, PAR)
    assert got == expected
    if got is not None:
        assert got == _every_unit(w, units)
    assert patterns._injective_on(w, units, PAR, None, sample=False) == _every_unit(w, units)


def test_not_applied_where_it_cannot_gain_or_units_are_not_consecutive():
    w = MemorySlice("T", Level.GLOBAL, (U // 64) * 8192 + (U % 64) * 128 + I * 16 + J, 8, 16, F32)
    assert injective_by_period(w, np.arange(0, 128, dtype=np.int64), PAR) is None          # 2 periods < GAIN
    assert injective_by_period(w, np.arange(0, 1024, 2, dtype=np.int64), PAR) is None      # not consecutive
    shared = MemorySlice("T", Level.SHARED, (U % 4) * 128 + I * 16 + J, 8, 16, F32)
    assert injective_by_period(shared, np.arange(0, 12, dtype=np.int64), PAR) is None   # 3 groups < GAIN