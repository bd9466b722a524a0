"""Property tests of the index-heavy converters (Slice, pooling, Conv) against onnxruntime
on random geometries; float32 tolerances 1e-5 (pooling/slice) and 1e-4 (conv)."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.frontend.fe_helpers import check, make_model

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BIG = 2 ** 62


@SETTINGS
@given(st.data())
def test_slice_random(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    axes = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=len(shape),
                              unique_by=lambda a: a % len(shape)))
    bound = st.one_of(st.integers(-8, 8), st.sampled_from([BIG, -BIG]))
    starts = [data.draw(bound) for _ in axes]
    ends = [data.draw(bound) for _ in axes]
    steps = [data.draw(st.sampled_from([1, 2, 3, -1, -2])) for _ in axes]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    consts = {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64), "a": np.array(axes, np.int64),
              "t": np.array(steps, np.int64)}
    check(make_model("Slice", {"x": x}, consts), {"x": x})


@st.composite
def pool_geometry(draw):
    rank = draw(st.sampled_from([1, 2]))
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    pads = [draw(st.integers(0, k - 1)) for k in kernel] + [draw(st.integers(0, k - 1)) for k in kernel]
    spatial = [draw(st.integers(k + 1, 9)) for k in kernel]
    return spatial, {"kernel_shape": kernel, "strides": strides, "pads": pads,
                     "ceil_mode": draw(st.sampled_from([0, 1]))}


@SETTINGS
@given(pool_geometry(), st.sampled_from(["MaxPool", "AveragePool-0", "AveragePool-1"]))
def test_pooling_random(geometry, kind):
    spatial, attrs = geometry
    op = kind.split("-")[0]
    if op == "AveragePool":
        attrs = dict(attrs, count_include_pad=int(kind[-1]))
    x = np.random.default_rng(1).standard_normal([1, 2] + spatial).astype(np.float32)
    check(make_model(op, {"x": x}, attrs=attrs, opset=19), {"x": x})


@SETTINGS
@given(st.data())
def test_conv_random(data):
    rank = data.draw(st.sampled_from([1, 2]))
    group = data.draw(st.sampled_from([1, 2]))
    kernel = [data.draw(st.integers(1, 3)) for _ in range(rank)]
    dil = [data.draw(st.integers(1, 2)) for _ in range(rank)]
    spatial = [data.draw(st.integers((k - 1) * d + 1, 8)) for k, d in zip(kernel, dil)]
    attrs = {"strides": [data.draw(st.integers(1, 2)) for _ in range(rank)], "dilations": dil, "group": group}
    # onnxruntime refuses SAME_* padding with dilations
    autos = ["NOTSET", "VALID"] + (["SAME_UPPER", "SAME_LOWER"] if dil == [1] * rank else [])
    auto = data.draw(st.sampled_from(autos))
    if auto == "NOTSET":
        attrs["pads"] = [data.draw(st.integers(0, 2)) for _ in range(2 * rank)]
    else:
        attrs["auto_pad"] = auto
    rng = np.random.default_rng(2)
    x = rng.standard_normal([2, 2 * group] + spatial).astype(np.float32)
    w = rng.standard_normal([2 * group, 2] + kernel).astype(np.float32)
    check(make_model("Conv", {"x": x}, {"w": w, "b": rng.standard_normal(2 * group).astype(np.float32)}, attrs),
          {"x": x}, rtol=1e-4, atol=1e-4)


@st.composite
def broadcast_pair(draw):
    out = draw(st.lists(st.integers(1, 4), min_size=0, max_size=4))
    def operand():
        rank = draw(st.integers(0, len(out)))
        tail = out[len(out) - rank:]
        return [d if draw(st.booleans()) else 1 for d in tail]
    return operand(), operand()


@SETTINGS
@given(broadcast_pair(), st.sampled_from(["Add", "Sub", "Mul", "Max", "Min", "Greater", "Where"]))
def test_broadcasting_random(shapes, op):
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    if op == "Where":
        feeds = {"c": np.asarray(rng.random(shapes[1]) > 0.5), "a": a, "b": b}
    else:
        feeds = {"a": a, "b": b}
    check(make_model(op, feeds), feeds)
