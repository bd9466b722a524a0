"""One memory estimate before anything is allocated: the bytes a model declares.

After shape inference every tensor has a static shape, so the bytes of each one -- and of all
of them together, which is what the CPU session holds at its peak (it keeps every tensor of
a run) -- are known before constant folding, conversion, a session or random inputs
allocate anything. A model beyond `powerfusion.options.current().memory_limit` is refused
with a ModelError naming its largest tensors, so a 149-byte file declaring a 4 TiB constant
costs nothing. External tensor data is checked against its declared shape before it is read.
"""
from __future__ import annotations

import os

import numpy as np
import onnx

from powerfusion.errors import ModelError


def tensor_bytes(elem_type: int, dims) -> int:
    try:
        item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except (KeyError, TypeError, ValueError):
        item = 8
    n = 1
    for d in dims:
        n *= max(int(d), 0)
    return n * max(item, 1)


def declared_tensors(proto: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> bytes, for every tensor of the main graph with a static shape."""
    g = proto.graph
    out: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        dims = t.shape.dim
        if vi.type.HasField("tensor_type") and t.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tensor_bytes(t.elem_type, [d.dim_value for d in dims])
    for init in g.initializer:
        out[init.name] = tensor_bytes(init.data_type, init.dims)
    return out


def check_memory(proto: onnx.ModelProto, where: str, limit: int | None = None) -> None:
    if limit is None:
        from powerfusion import options
        limit = options.current().memory_limit
    sizes = declared_tensors(proto)
    total = sum(sizes.values())
    if total <= limit:
        return
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    named = ", ".join(f"'{n}' {_human(b)}" for n, b in top)
    raise ModelError(f"{where} declares {_human(total)} of tensors (largest: {named}), beyond the memory limit "
                     f"of {_human(limit)}; raise it with the memory_limit option or POWERFUSION_MEMORY_LIMIT "
                     f"if this is intended")


def check_external_tensor(t: onnx.TensorProto, base_dir: str, where: str, limit: int | None = None) -> None:
    """An external tensor's stored bytes must match its shape before it is read."""
    if limit is None:
        from powerfusion import options
        limit = options.current().memory_limit
    info = {e.key: e.value for e in t.external_data}
    want = tensor_bytes(t.data_type, t.dims)
    if want > limit:
        raise ModelError(f"{where}: tensor '{t.name}' {list(t.dims)} needs {_human(want)}, beyond the memory "
                         f"limit of {_human(limit)}")
    path = os.path.join(base_dir, info.get("location", ""))
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else os.path.getsize(path) - offset
    except (OSError, ValueError):
        return   # the loader reports a missing or unreadable file with its own message
    if length != want and t.data_type not in (onnx.TensorProto.STRING,):
        raise ModelError(f"{where}: tensor '{t.name}' {list(t.dims)} needs {want} bytes but its external data "
                         f"in '{info.get('location')}' holds {length} (offset {offset}"
                         f"{'' if 'length' in info else ', no length given'})")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def check_initializer_data(proto: onnx.ModelProto, where: str) -> None:
    """Every (in-file) initializer holds as many values as its dimensions say."""
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        n = 1
        for d in t.dims:
            n *= int(d)
        if t.HasField("raw_data"):
            have = len(t.raw_data)
            want = tensor_bytes(t.data_type, t.dims)
            if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
                want = (n + 1) // 2
        else:
            have = max((len(getattr(t, f)) for f in _FIELDS), default=0)
            want = n
            if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
                want = 2 * n
            if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
                want = (n + 1) // 2
        if have != want:
            raise ModelError(f"{where}: initializer '{t.name}' has dimensions {list(t.dims)} ({n} values) but "
                             f"holds {have} {'bytes' if t.HasField('raw_data') else 'values'} of data")
