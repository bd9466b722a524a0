"""Resize (and Upsample, upgraded to Resize), decomposed per resized axis.

Resize is separable: along each resized axis, output o is a fixed weighted sum of inputs,
so the axis is resized by a constant [O, L] matrix. The weights are those of
`onnx.reference` itself (its 1-D interpolation applied to an identity matrix, which is
exact: the interpolation is linear in the data), so every mode, coordinate transformation,
cubic coefficient, exclude_outside and antialias setting follows the standard's own
definition. Nearest mode has one weight 1 per row and becomes a Gather (exact for every
dtype); linear and cubic become a MatMul with the constant matrix (float inputs only).
Positions that tf_crop_and_resize puts outside the input get `extrapolation_value`.
"""
from __future__ import annotations

import numpy as np

from powerfusion.basic import Gather
from powerfusion.frontend.builder import NodeCtx
from powerfusion.frontend.ops_nn import matmul


def _coefficient_fn(mode: str, nearest_mode: str, cubic_a: float, antialias: bool):
    from onnx.reference.ops import op_resize as R
    if mode == "nearest":
        return lambda x, scale: R._nearest_coeffs(x, mode=nearest_mode)
    if mode == "cubic":
        fn = R._cubic_coeffs_antialias if antialias else R._cubic_coeffs
        return lambda x, scale: fn(x, scale, A=cubic_a)
    return R._linear_coeffs_antialias if antialias else R._linear_coeffs


def axis_weights(length: int, scale: float, size: int, coeffs, roi, ctm: str, exclude_outside: bool):
    """([size, length] weights, [size] bool: position outside the input (tf_crop_and_resize))."""
    from onnx.reference.ops.op_resize import _interpolate_1d_along_axis as interpolate
    eye = np.eye(length, dtype=np.float64)
    w = interpolate(eye, 0, scale, size, coeffs, roi=roi, extrapolation_value=0.0,
                    coordinate_transformation_mode=ctm, exclude_outside=exclude_outside)
    probe = interpolate(np.ones((length, 1)), 0, scale, size, coeffs, roi=roi, extrapolation_value=np.nan,
                        coordinate_transformation_mode=ctm, exclude_outside=exclude_outside)
    return np.asarray(w, dtype=np.float64), np.isnan(probe[:, 0])


def _scales_and_sizes(cx: NodeCtx, shape, axes):
    """Per-axis scale and output size, as onnx.reference computes them (keep_aspect_ratio_policy
    included)."""
    r = len(shape)
    scales_in = cx.const(2)
    sizes_in = cx.const(3) if cx.has(3) else None
    if sizes_in is not None and np.asarray(sizes_in).size:
        size = list(shape)
        for a, s in zip(axes, np.asarray(sizes_in).reshape(-1)):
            size[a] = int(s)
        scale = [size[i] / shape[i] for i in range(r)]
        policy = cx.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            common = pick(scale[a] for a in axes)
            scale = [common if i in axes else 1.0 for i in range(r)]
            size = [int(common * shape[i] + 0.5) if i in axes else shape[i] for i in range(r)]
        return scale, size
    if scales_in is None or not np.asarray(scales_in).size:
        cx.fail("Resize needs scales or sizes")
    scale = [1.0] * r
    for a, s in zip(axes, np.asarray(scales_in, dtype=np.float64).reshape(-1)):
        scale[a] = float(s)
    return scale, [int(scale[i] * shape[i]) for i in range(r)]


def resize_unsupported(cx: NodeCtx) -> str | None:
    mode = cx.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        return f"Resize mode '{mode}' is unknown"
    return None


def convert_resize(cx: NodeCtx):
    shape = cx.shape(0)
    r = len(shape)
    axes = [cx.axis(a, r) for a in (cx.attr("axes", None) or range(r))]
    scale, size = _scales_and_sizes(cx, shape, axes)
    roi = cx.const(1) if cx.has(1) else None
    roi = None if roi is None or not np.asarray(roi).size else np.asarray(roi, dtype=np.float64).reshape(-1)
    mode = cx.attr("mode", "nearest")
    coeffs = _coefficient_fn(mode, cx.attr("nearest_mode", "round_prefer_floor"),
                             float(cx.attr("cubic_coeff_a", -0.75)), bool(cx.attr("antialias", 0)))
    ctm = cx.attr("coordinate_transformation_mode", "half_pixel")
    x = cx.inp(0)
    for k, a in enumerate(axes):
        axis_roi = None if roi is None else [roi[k], roi[k + len(axes)]]
        unchanged = np.isclose(scale[a], 1.0) and size[a] == shape[a] and (
            axis_roi is None or (np.isclose(axis_roi[0], 0.0) and np.isclose(axis_roi[1], 1.0)))
        if unchanged:
            continue
        w, outside = axis_weights(shape[a], scale[a], size[a], coeffs, axis_roi, ctm,
                                  bool(cx.attr("exclude_outside", 0)))
        x = _apply_axis(cx, x, a, w, outside, float(cx.attr("extrapolation_value", 0.0)))
    if x == cx.node.input[0]:
        cx.reshape(x, shape, out=cx.out())
    else:
        cx.alias(x, cx.out())


def _apply_axis(cx: NodeCtx, x: str, axis: int, w: np.ndarray, outside: np.ndarray, extrapolation: float) -> str:
    shape, dt = cx.info(x).shape, cx.info(x).dtype
    oshape = shape[:axis] + (w.shape[0],) + shape[axis + 1:]
    one_hot = np.all((w == 0) | (w == 1)) and np.all(w.sum(axis=1) == 1)
    if one_hot:
        idx = cx.b.constant(np.argmax(w, axis=1).astype(np.int64), hint="resize_index")
        y = cx.emit(Gather(axis), [x, idx], oshape, dt)
    else:
        if dt.kind != "f" and dt.name != "bfloat16":
            cx.fail(f"Resize mode '{cx.attr('mode')}' on {dt.name} data is not supported (float data only)")
        y = _weighted(cx, x, axis, w.astype(np.float32 if dt.itemsize <= 4 else dt))
    if outside.any():   # the weights of those rows are 0 (matrix) or an edge element (Gather)
        view = [1] * len(oshape)
        view[axis] = len(outside)
        mask = cx.b.constant(outside.reshape(view), hint="resize_outside")
        y = cx.ew("where", mask, cx.scalar(extrapolation, dt), y)
    return y


def _weighted(cx: NodeCtx, x: str, axis: int, w: np.ndarray) -> str:
    """x with `axis` replaced by w @ x along it (computed in float32 for 16-bit data)."""
    shape, dt = cx.info(x).shape, cx.info(x).dtype
    r = len(shape)
    xf = cx.cast(x, w.dtype)
    if axis == r - 1:
        y = matmul(cx, xf, cx.b.constant(np.asarray(w.T, order="C"), hint="resize_weights"))
    elif axis == r - 2:
        y = matmul(cx, cx.b.constant(w, hint="resize_weights"), xf)
    else:
        perm = [i for i in range(r) if i != axis] + [axis]
        t = cx.transpose(xf, perm)
        y = matmul(cx, t, cx.b.constant(np.asarray(w.T, order="C"), hint="resize_weights"))
        inverse = [perm.index(i) for i in range(r)]
        y = cx.transpose(y, inverse)
    return cx.cast(y, dt)


CONVERTERS = {"Resize": convert_resize}
CHECKS = {"Resize": resize_unsupported}
CONST_INPUTS = {"Resize": (1, 2, 3)}
