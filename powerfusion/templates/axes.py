"""Axis collapsing for data movement: a transpose touches the same elements in the same order
whether two input axes that stay adjacent (and in order) in the output are two axes or one.
Merging them first gives the templates the longest contiguous runs to tile: the channel
shuffle's [n, 2, c, h, w] -> [n, c, 2, h, w] is [n, 2, c, h*w] -> [n, c, 2, h*w], so a row is a
whole h*w plane (784 elements, float4 vectors) instead of one 28-element image row, and no unit
index needs the div/mod chain of the h and w axes."""
from __future__ import annotations

from typing import Sequence


def collapse_transpose(shape: Sequence[int], perm: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape', perm') with extent-1 axes dropped and each run of input axes that the
    permutation keeps adjacent and in order merged into one axis; transposing x viewed with
    shape' by perm' yields the same flat output as transposing x by perm. Rank >= 1."""
    kept = [d for d in perm if shape[d] != 1]
    if not kept:
        return (1,), (0,)
    runs: list[list[int]] = []          # runs of input axes, in output order
    for d in kept:
        if runs and _next_kept(shape, runs[-1][-1]) == d:
            runs[-1].append(d)
        else:
            runs.append([d])
    by_input = sorted(range(len(runs)), key=lambda r: runs[r][0])
    new_shape = tuple(_prod(shape[d] for d in runs[r]) for r in by_input)
    pos = {r: k for k, r in enumerate(by_input)}
    return new_shape, tuple(pos[r] for r in range(len(runs)))


def _next_kept(shape, d: int) -> int | None:
    """The next input axis after d that is not of extent 1 (extent-1 axes do not separate runs)."""
    for e in range(d + 1, len(shape)):
        if shape[e] != 1:
            return e
    return None


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
