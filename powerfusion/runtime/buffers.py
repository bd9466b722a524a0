"""Static memory planning: place intermediate tensors in one arena, reusing space.

Each tensor has a size in bytes and a live range [first, last] of step indices (it is
written at `first` and last read at `last`; both inclusive). Two tensors whose ranges
intersect must not overlap in memory. Placement is the greedy-by-size, best-fit heuristic
(largest tensor first; each goes into the smallest gap left by the already-placed
tensors that are live at the same time, else on top of them), which is what TFLite's
arena planner does and stays close to the lower bound on typical inference graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGNMENT = 256  # bytes; cudaMalloc's alignment, so every tensor starts 256-byte aligned


@dataclass(frozen=True, slots=True)
class TensorLife:
    name: str
    size: int      # bytes
    first: int     # step that writes it
    last: int      # last step that reads it

    def overlaps(self, other: "TensorLife") -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True, slots=True)
class BufferPlan:
    offsets: dict[str, int]     # tensor name -> byte offset in the arena
    arena_bytes: int            # arena size (a multiple of the alignment)
    alignment: int

    def peak_live_bytes(self, tensors: list[TensorLife]) -> int:
        """Largest sum of aligned sizes live at one step: a lower bound for arena_bytes."""
        steps = {t.first for t in tensors}
        return max((sum(_align(t.size, self.alignment) for t in tensors if t.first <= s <= t.last)
                    for s in steps), default=0)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_buffers(tensors: list[TensorLife], alignment: int = ALIGNMENT) -> BufferPlan:
    """Assign each tensor an aligned offset in one arena; simultaneously live tensors never overlap."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    names = set()
    for t in tensors:
        if t.size < 0 or t.first > t.last:
            raise ValueError(f"tensor '{t.name}': bad size {t.size} or live range [{t.first}, {t.last}]")
        if t.name in names:
            raise ValueError(f"tensor '{t.name}' appears twice")
        names.add(t.name)

    placed: list[tuple[TensorLife, int, int]] = []  # (tensor, offset, aligned size)
    offsets: dict[str, int] = {}
    # Largest first; ties by earlier first use then name, so plans are deterministic.
    for t in sorted(tensors, key=lambda t: (-t.size, t.first, t.name)):
        size = _align(max(t.size, 1), alignment)
        busy = sorted((off, off + sz) for other, off, sz in placed if other.overlaps(t))
        offsets[t.name] = _best_fit(busy, size)
        placed.append((t, offsets[t.name], size))
    arena = max((off + sz for _, off, sz in placed), default=0)
    return BufferPlan(offsets, arena, alignment)


def _best_fit(busy: list[tuple[int, int]], size: int) -> int:
    """Smallest gap between busy intervals (sorted by start) that holds `size`, else the top."""
    best, best_gap, cursor = None, None, 0
    for start, end in busy:
        gap = start - cursor
        if gap >= size and (best_gap is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, end)
    return cursor if best is None else best
