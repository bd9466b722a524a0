"""Cost hooks of the C-style backends (registered for cuda and hip in targets/registry.py):
what the cost model needs to know about how this renderer executes a kernel."""
from __future__ import annotations

from powerfusion.backends.cstyle.kernel import KernelRenderer, vector_copy_ok
from powerfusion.backends.cstyle.streaming import STREAM_SLOTS, Run, stream_segments
from powerfusion.gir.ir import GIRGraph, GOp


def streamed_ops(renderer, graph: GIRGraph, ops: tuple[GOp, ...], registers_per_lane: int) -> list[GOp] | None:
    """The ops as the renderer will execute them when it streams the kernel's long tiles
    (streaming.py): the rows' recomputing loads appear again in each later loop (another pass
    over the input), and no tile is whole in registers. None when the kernel is not streamed."""
    if registers_per_lane < STREAM_SLOTS:
        return None
    try:
        segs = stream_segments(KernelRenderer(renderer, graph, ops, "cost"))
    except Exception:   # a layout the renderer rejects: the search's feasibility check says so
        return None
    if segs is None:
        return None
    return [o for seg in segs for o in (seg.ops if isinstance(seg, Run) else (seg,))]


def vector_copy(src, dst, lanes: int) -> bool:
    """Is a global -> global move of these slices rendered as vector copies (kernel.py
    `_vector_copy`)? The cost model prices it at the slices' vector width only then."""
    return vector_copy_ok(src, dst, lanes)
