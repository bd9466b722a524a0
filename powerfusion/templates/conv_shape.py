"""The static shape of a 2-D Conv (or Involution) node, as the window templates (stencil, strip) tile it."""
from __future__ import annotations

from dataclasses import dataclass, fields

from powerfusion import basic as B
from powerfusion.templates.common import Ctx, Infeasible


@dataclass(frozen=True)
class ConvShape:
    N: int
    C: int
    Cout: int
    IH: int
    IW: int
    OH: int
    OW: int
    KH: int
    KW: int
    sh: int
    sw: int
    dh: int
    dw: int
    ph: int      # padding before, rows
    pw: int      # padding before, columns

    def values(self) -> dict:
        """The fields by name, for a subclass built from this shape plus its own fields."""
        return {f.name: getattr(self, f.name) for f in fields(ConvShape)}


def conv_shape(ctx: Ctx, template: str) -> ConvShape:
    """Of a Conv, or of an Involution (a window per output channel, as a depthwise conv's)."""
    op: B.Conv | B.Involution = ctx.node.op
    x, w = ctx.node.inputs[:2]
    xs, ws = ctx.tensors[x].shape, ctx.tensors[w].shape
    ys = ctx.tensors[ctx.node.outputs[0]].shape
    if len(xs) != 4:
        raise Infeasible(f"the {template} tiles 2-D convolutions")
    if getattr(op, "channels_last", False):
        raise Infeasible(f"the {template} tiles NCHW windows; a channels-last conv runs as conv.depthwise.cols")
    if isinstance(op, B.Involution):
        return ConvShape(xs[0], xs[1], xs[1], xs[2], xs[3], ys[2], ys[3], op.kernel[0], op.kernel[1], op.strides[0],
                         op.strides[1], op.dilations[0], op.dilations[1], op.pad_begins[0], op.pad_begins[1])
    return ConvShape(xs[0], xs[1], ws[0], xs[2], xs[3], ys[2], ys[3], ws[2], ws[3], op.strides[0], op.strides[1],
                     op.dilations[0], op.dilations[1], op.pad_begins[0], op.pad_begins[1])
