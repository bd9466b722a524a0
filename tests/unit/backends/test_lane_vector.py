"""When the C renderers load or store a global slice as whole vectors (`_aligned`): an index
affine in j from an aligned start, or the lane-vector form `rest + j % vec` (j in rest only as
j // vec, rest a multiple of vec by its form) that a flat tiling's per-position loads take. The
positive cases are checked element by element: each lane's vec elements are consecutive from a
multiple of vec."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.backends.cstyle.kernel import _aligned
from powerfusion.gir.expr import I, J, U, evaluate

VEC = 4
# positions of a flat tiling over 16 x 56 x 56 planes (W = 128 per unit), and the kernel tensor's
# index of (plane // 16, tap i, position): the involution strip's per-position kernel load
Q = (U * 128 + (J // VEC) * VEC)
KERNEL = ((Q // 3136 // 16) * 9 + I) * 3136 + (Q % 3136) + J % VEC
REFIT = (I % 3) * 3136 + (I // 3) * 9408 + J % VEC + ((U * 32 + J // VEC) % 14) * 4 \
    + ((U * 32 + J // VEC) // 14 % 56) * 56


@pytest.mark.parametrize("index", [U * 128 + J, KERNEL, REFIT], ids=["affine", "per-position", "radix-refit"])
def test_vector_forms_are_consecutive_and_aligned(index):
    assert _aligned(index, VEC)
    u, i, j = np.meshgrid(np.arange(40), np.arange(9), np.arange(128), indexing="ij")
    got = evaluate(index, {"u": u, "i": i, "j": j})
    lanes = got.reshape(40, 9, 32, VEC)
    assert (lanes[..., 0] % VEC == 0).all()
    assert (np.diff(lanes, axis=-1) == 1).all()


@pytest.mark.parametrize("index", [
    (Q % 3136) + J % 2,                 # the lane term is not j % vec
    (Q % 3135) + J % VEC,               # rest not a multiple of vec (3135)
    U * 128 + J + (J % VEC),            # j outside j // vec in rest
    (Q % 3136) + 1 + J % VEC,           # rest offset by one: consecutive but unaligned
], ids=["other-modulus", "odd-plane", "j-in-rest", "unaligned"])
def test_other_forms_are_not_taken_whole(index):
    assert not _aligned(index, VEC)
