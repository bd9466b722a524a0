"""Transposes collapse to their fewest axes: extent-1 axes dropped, axes that stay adjacent
and in order merged. The collapsed transpose moves the same elements to the same places."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from powerfusion.templates.axes import collapse_transpose


@pytest.mark.parametrize("shape,perm,want", [
    ((64, 2, 116, 28, 28), (0, 2, 1, 3, 4), ((64, 2, 116, 784), (0, 2, 1, 3))),   # channel shuffle
    ((2, 3, 4, 5), (0, 2, 3, 1), ((2, 3, 20), (0, 2, 1))),                         # NCHW -> NHWC
    ((4, 12, 1, 64), (0, 2, 1, 3), ((3072,), (0,))),                               # only a unit axis moves
    ((3, 4), (0, 1), ((12,), (0,))),
    ((1, 1), (1, 0), ((1,), (0,))),
])
def test_collapse_known_forms(shape, perm, want):
    assert collapse_transpose(shape, perm) == want


@pytest.mark.parametrize("shape", [(2, 3, 1, 4), (1, 2, 2, 3), (3, 1, 2, 1, 2)])
def test_collapsed_transpose_moves_the_same_elements(shape):
    x = np.arange(int(np.prod(shape))).reshape(shape)
    for perm in itertools.permutations(range(len(shape))):
        cshape, cperm = collapse_transpose(shape, perm)
        assert len(cshape) == len(cperm) <= len(shape)
        np.testing.assert_array_equal(np.transpose(x.reshape(cshape), cperm).ravel(), np.transpose(x, perm).ravel(),
                                      err_msg=f"{shape} {perm} -> {cshape} {cperm}")
