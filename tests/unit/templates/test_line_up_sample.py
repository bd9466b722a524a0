"""The line-up heuristic's sample of reader units is drawn once per unit sets (templates/merge.py:
_sample_units), the same units a fresh draw gives."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.templates import merge


def _units(n, start=0):
    u = np.arange(start, start + n, dtype=np.int64)
    u.flags.writeable = False
    return u


def test_the_sample_is_drawn_once_and_shared_read_only():
    merge._SAMPLED.clear()
    sets = [_units(5000), _units(300, 9000)]
    first = merge._sample_units(sets, 8)
    assert merge._sample_units([_units(5000), _units(300, 9000)], 8) is first
    assert np.array_equal(first, merge._sample_of(sets, 8)) and len(first) == 16
    with pytest.raises(ValueError):
        first[0] = 1


def test_other_unit_sets_or_sizes_get_their_own_sample():
    merge._SAMPLED.clear()
    a = merge._sample_units([_units(5000)], 8)
    assert merge._sample_units([_units(5001)], 8) is not a
    assert len(merge._sample_units([_units(5000)], 12)) == 12
    assert np.array_equal(merge._sample_units([_units(6)], 8), np.arange(6))
