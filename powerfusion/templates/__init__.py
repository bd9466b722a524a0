"""Per-basic-op GIR templates and their parameter spaces (docs/design.md, "The pipeline").

`candidates(node, tensors, target)` lists candidate GIR graphs for one basic node: each
`Candidate` has a template `name`, frozen `params` and `build() -> GIRGraph`. Every
candidate is a complete graph of its own (load inputs from GLOBAL, compute in
REGISTER, store outputs to GLOBAL, syncs where a phase needs other units' data).
The first candidate is the default; `powerfusion.templates.merge` picks among them so that
neighbouring ops' slice patterns line up.

Templates (name: parameters):
  elementwise / broadcast / reshape / slice / pad / gather / gather_elements / window
  / transpose.direct_out / transpose.direct_in / concat.by_input: `.rows` `.chunk`
  `.cyclic` with maps.TileParams(kind, vec, split, num, units)
  concat.rows: TileParams (one unit per output row; guarded loads per input)
  transpose.tiled: ops_tiled.TileTransposeParams(tile, units) (SHARED tile, BLOCK sync)
  reduce.row_warp / .cols / .block / .grid: ops_reduce.ReduceParams(style, vec, split)
  matmul.dot / .cols, conv.depthwise.dot / .cols: ops_matmul.DotParams(style, vec) (no dot for
  depthwise windows under two warps)
  conv.depthwise.stencil, involution.stencil: ops_stencil.StencilParams(vec) (SHARED input tile +
  halo, BLOCK sync; an involution loads each position's kernel where the conv loads its weights)
  involution.strip / .dot / .cols: the depthwise conv's forms, loading a kernel per position
  conv.depthwise.strip: ops_strip.StripParams(layout, vec) (vector chunks of each window row,
  the window built by in-lane register moves)
Conventions: compute on REGISTER tiles in the identity layout (index i*width + j), fp16 and
bf16 widened to float32 in registers, W = lanes*vec (1 for one-element rows), tails masked
by `valid` on the GLOBAL slices and on the register tiles reductions read.
"""
from __future__ import annotations

from typing import Callable

from powerfusion import basic as B
from powerfusion.templates.common import Candidate, Ctx, buffer_names, resolve_target, sanitize
from powerfusion.templates import ops_map, ops_reduce, ops_matmul, ops_stencil, ops_strip, ops_tiled

TEMPLATES: dict[type, Callable[[Ctx], list[Candidate]]] = {
    B.Elementwise: ops_map.elementwise,
    B.Broadcast: ops_map.broadcast,
    B.Reshape: ops_map.reshape,
    B.Transpose: lambda ctx: ops_tiled.transpose_tiled(ctx) + ops_map.transpose_direct(ctx),
    B.Slice: ops_map.slice_,
    B.Concat: lambda ctx: ops_tiled.concat_rows(ctx) + ops_map.concat(ctx),
    B.Pad: ops_map.pad,
    B.Gather: ops_map.gather,
    B.GatherElements: ops_map.gather_elements,
    B.Window: ops_map.window,
    B.Reduce: ops_reduce.reduce,
    B.MatMul: ops_matmul.matmul,
    B.Conv: lambda ctx: ops_matmul.conv(ctx) + ops_stencil.conv_stencil(ctx) + ops_strip.conv_strip(ctx),
    B.Involution: lambda ctx: ops_stencil.conv_stencil(ctx) + ops_strip.conv_strip(ctx) + ops_matmul.involution(ctx),
}


def candidates(node: B.BasicNode, tensors: dict, target="cuda", names: dict | None = None,
               prefix: str = "") -> list[Candidate]:
    """Candidate GIR graphs for one basic node. `names` maps tensor names to GLOBAL buffer
    names (default: sanitised); `prefix` namespaces register/shared buffer names."""
    names = names if names is not None else buffer_names(list(node.inputs) + list(node.outputs))
    ctx = Ctx(node, tensors, resolve_target(target), names, prefix)
    fn = TEMPLATES.get(type(node.op))
    if fn is None:
        raise ctx.error(f"no GIR template for basic op kind {type(node.op).__name__}")
    return _distinct(fn(ctx))


def _distinct(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that build the same graph as an earlier one (e.g. rows split at a size-1
    dim), so labels are unique and the search does not evaluate a plan twice."""
    out, seen = [], set()
    for c in cands:
        g = c.build()
        key = (g.parallel, g.ops)
        if key in seen or c.label in {o.label for o in out}:
            continue
        seen.add(key)
        out.append(c)
    return out


__all__ = ["Candidate", "candidates", "TEMPLATES", "buffer_names", "sanitize"]
