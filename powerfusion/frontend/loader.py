"""Load an ONNX model, check it, make every input shape static and infer all shapes.

Opset policy for the default domain:
  * 11..21 are accepted as they are;
  * 7..10 are upgraded to opset 11 with onnx.version_converter (old model-zoo
    files, e.g. the onnx package's `light_*` CNNs, are opset 9);
  * 22 and above are accepted when every op the model uses has, at the model's
    opset, the same inputs, outputs and attributes (names, defaults) as at
    opset 21 -- only its type lists may have grown (opset 22 added bfloat16 to
    Conv, pooling, ...) -- so that our opset-21 converters read it correctly;
    otherwise an error lists the ops that changed.
"""
from __future__ import annotations

import functools
import math
import os
import re

import numpy as np
import onnx
from onnx import shape_inference

from powerfusion.errors import ModelError, PowerFusionError
from powerfusion.frontend.converters import raise_unsupported
from powerfusion.frontend.inference_errors import describe_failure
from powerfusion.frontend.memory_check import check_external_tensor, check_initializer_data, check_memory
from powerfusion.frontend.onnx_graph import DEFAULT_DOMAINS, default_opset
from powerfusion.frontend.quantized import inference_stand_ins

MIN_OPSET, MAX_OPSET = 11, 21
MIN_UPGRADABLE_OPSET = 7
# ops whose definitions after MAX_OPSET our converters read as they are: Cast/CastLike's
# round_mode (opset 24) only affects float8e8m0 results, a type we reject; SpaceToDepth's
# mode (opset 28) is read by its converter; Range's stash_type (opset 27) is folded by
# the reference, which knows it
READ_AFTER_MAX = {"Cast", "CastLike", "SpaceToDepth", "Range"}


def load_model(model, shapes: dict[str, tuple[int, ...]] | None = None, *,
               sources: list[str] | None = None) -> onnx.ModelProto:
    """Path, bytes or ModelProto -> checked ModelProto with static shapes inferred everywhere.
    With `sources`, the paths of the external-data files a model file reads are appended to it."""
    proto, where = _read(model, sources)
    skeleton, weights = _skeleton(proto)
    try:
        onnx.checker.check_model(skeleton)
    except Exception as e:  # checker raises ValidationError and friends
        raise ModelError(f"{where} is not a valid ONNX model: onnx.checker says: {_first_line(e)}") from None
    upgraded = _check_opset(skeleton, where)
    if upgraded is not skeleton:  # upgraded without the weights; they stay where they are
        _adopt(proto, upgraded, weights)
        skeleton = upgraded
    _fix_input_shapes(proto, shapes or {}, where, weights)
    _fix_input_shapes(skeleton, shapes or {}, where, weights)
    try:
        inferred = _infer(skeleton, where)
    except PowerFusionError:
        if not _match_norm_params(proto, skeleton, where):
            raise
        inferred = _infer(skeleton, where)
    _annotate(proto, inferred)
    check_memory(proto, where)   # before folding or converting allocates anything
    check_initializer_data(proto, where)
    return proto


def infer_shapes(proto: onnx.ModelProto, where: str = "the model") -> onnx.ModelProto:
    """Strict shape inference with data propagation, written into `proto` (which is returned)."""
    skeleton, _ = _skeleton(proto)
    _annotate(proto, _infer(skeleton, where))
    return proto


def _infer(proto: onnx.ModelProto, where: str) -> onnx.ModelProto:
    proto = inference_stand_ins(proto)  # onnx knows no MatMulNBits: same-shaped MatMuls stand in
    try:
        return shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        error = ModelError(f"shape inference failed on {where}: {describe_failure(proto, e, default_opset(proto))}")
    # ops we do not know (custom domains...) also stop strict inference: report those instead
    raise_unsupported(shape_inference.infer_shapes(proto, data_prop=True))
    raise error


# The checker and shape inference serialize the whole model (seconds for a 500 MB
# transformer). They run on a skeleton instead: the model without its large
# initializers (weights, never shape data), which stand in as typed graph inputs;
# inferred types are then written back into the full model.
LARGE_INITIALIZER_BYTES = 1 << 16


NORMS = {"LayerNormalization": (1, 2), "BatchNormalization": (1, 2, 3, 4)}   # params of X's type


def _match_norm_params(proto: onnx.ModelProto, skeleton: onnx.ModelProto, where: str) -> bool:
    """torch's exporter writes some float16 models with a float32 residual stream into
    LayerNormalization (X float32, Scale and B float16: BERT-base in torch 2.11), which ONNX's
    one type T forbids (onnxruntime refuses the model too). Constant parameters of another float
    type than X are
    converted to X's type (float16 -> float32 is exact), with a warning, in `proto` and
    `skeleton`; True if any was. Called only after strict inference failed."""
    import warnings
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in shape_inference.infer_shapes(skeleton).graph.value_info}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in skeleton.graph.input})
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    inits = {t.name: t for t in skeleton.graph.initializer}
    changed: dict[str, int] = {}
    for node in skeleton.graph.node:
        x_type = types.get(node.input[0]) if node.op_type in NORMS and node.input else None
        if x_type not in floats:
            continue
        for i in NORMS[node.op_type]:
            name = node.input[i] if i < len(node.input) else ""
            t = inits.get(name)
            if t is not None and t.data_type in floats and t.data_type != x_type:
                changed[name] = x_type
    for g in (proto.graph, skeleton.graph):
        for k, t in enumerate(g.initializer):
            if t.name in changed:
                value = onnx.numpy_helper.to_array(t).astype(onnx.helper.tensor_dtype_to_np_dtype(changed[t.name]))
                g.initializer[k].CopyFrom(onnx.numpy_helper.from_array(value, t.name))
    if changed:
        warnings.warn(f"{where}: {len(changed)} normalization parameter(s) converted to their input's type "
                      f"(e.g. '{next(iter(changed))}'): ONNX requires one type, the exporter wrote two", stacklevel=3)
    return bool(changed)


def _skeleton(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, set[str]]:
    skel = onnx.ModelProto()
    _copy_fields(proto, skel, skip="graph")
    g, sg = proto.graph, skel.graph
    _copy_fields(g, sg, skip="initializer")
    weights = set()
    listed = {vi.name for vi in g.input}
    for t in g.initializer:
        if _tensor_bytes(t) <= LARGE_INITIALIZER_BYTES:
            sg.initializer.append(t)
            continue
        weights.add(t.name)
        if t.name not in listed:
            sg.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return skel, weights


def _copy_fields(src, dst, skip: str) -> None:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if hasattr(value, "extend"):  # repeated field
            getattr(dst, fd.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _adopt(proto: onnx.ModelProto, converted: onnx.ModelProto, weights: set[str]) -> None:
    """Take everything but the large initializers from a converted skeleton."""
    g, cg = proto.graph, converted.graph
    listed = {vi.name for vi in g.input}
    inputs = [vi for vi in cg.input if vi.name not in weights or vi.name in listed]
    for field, values in (("node", cg.node), ("input", inputs), ("output", cg.output),
                          ("value_info", cg.value_info)):
        del getattr(g, field)[:]
        getattr(g, field).extend(values)
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name not in weights]):
        del g.initializer[i]
    g.initializer.extend(cg.initializer)
    del proto.opset_import[:]
    proto.opset_import.extend(converted.opset_import)
    proto.ir_version = converted.ir_version


def _annotate(proto: onnx.ModelProto, inferred: onnx.ModelProto) -> None:
    g, ig = proto.graph, inferred.graph
    del g.value_info[:]
    g.value_info.extend(ig.value_info)
    outputs = {vi.name: vi for vi in ig.output}
    for vi in g.output:
        vi.CopyFrom(outputs[vi.name])


def _tensor_bytes(t: onnx.TensorProto) -> int:
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return 0
    return math.prod(t.dims) * _itemsize(t.data_type)


@functools.lru_cache(maxsize=None)
def _itemsize(data_type: int) -> int:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize


def parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """trtexec syntax: 'x:1x3x224x224,y:4' -> {'x': (1, 3, 224, 224), 'y': (4,)}; 'x:' is a scalar.
    The split is on the last ':' so names containing ':' still work."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise ModelError(f"bad --shapes entry '{item}': expected NAME:D1xD2x... (e.g. x:1x3x224x224)")
        if dims and not re.fullmatch(r"\d+(x\d+)*", dims):
            raise ModelError(f"bad --shapes entry '{item}': dimensions must be positive integers joined by 'x'")
        shapes[name] = tuple(int(d) for d in dims.split("x")) if dims else ()
    return shapes


# ---- helpers ------------------------------------------------------------------------

def _read(model, sources: list[str] | None = None) -> tuple[onnx.ModelProto, str]:
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # input shapes are fixed in place: leave the caller's proto alone
        return copy, f"model '{model.graph.name or 'unnamed'}'"
    if isinstance(model, (bytes, bytearray, memoryview)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as e:
            raise ModelError(f"the model bytes are not a serialized ONNX model: {_first_line(e)}") from None
        return proto, "the model bytes"
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise ModelError(f"model file '{path}' does not exist")
        try:
            proto = onnx.load(path, load_external_data=False)
            files = external_data_files(proto, os.path.dirname(path))
        except Exception as e:
            raise ModelError(f"model file '{path}' could not be parsed as ONNX: {_first_line(e)}") from None
        for f in files:
            if not os.path.isfile(f):
                raise ModelError(f"model file '{path}' keeps tensor data in '{f}', which does not exist")
        if files:
            for t in _external_tensors(proto):
                check_external_tensor(t, os.path.dirname(path) or ".", f"model file '{path}'")
            try:
                onnx.load_external_data_for_model(proto, os.path.dirname(path) or ".")
            except Exception as e:
                raise ModelError(f"model file '{path}': its external tensor data could not be read: "
                                 f"{_first_line(e)}") from None
        if sources is not None:
            sources.extend(files)
        return proto, f"model file '{path}'"
    raise ModelError(f"cannot load a model from a {type(model).__name__}; give a path, bytes or onnx.ModelProto")


def _external_tensors(proto: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors
    return [t for t in _get_all_tensors(proto) if t.data_location == onnx.TensorProto.EXTERNAL]


def external_data_files(proto: onnx.ModelProto, base_dir: str) -> list[str]:
    """Paths of the files that the model's external-data tensors name (initializers and tensor
    attributes, subgraphs included), in first-use order."""
    files: dict[str, None] = {}

    def tensor(t) -> None:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    files.setdefault(os.path.join(base_dir, e.value))

    def graph(g) -> None:
        for t in g.initializer:
            tensor(t)
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    tensor(a.t)
                for t in a.tensors:
                    tensor(t)
                if a.HasField("g"):
                    graph(a.g)
                for sub in a.graphs:
                    graph(sub)

    graph(proto.graph)
    return list(files)


def _check_opset(proto: onnx.ModelProto, where: str) -> onnx.ModelProto:
    opset = default_opset(proto)
    if MIN_OPSET <= opset <= MAX_OPSET:
        return proto
    if MIN_UPGRADABLE_OPSET <= opset < MIN_OPSET:
        from onnx import version_converter
        try:
            return version_converter.convert_version(proto, MIN_OPSET)
        except Exception as e:
            raise ModelError(f"{where} uses opset {opset}; upgrading it to opset {MIN_OPSET} failed "
                             f"({_first_line(e)}). Supported opsets: {MIN_OPSET}..{MAX_OPSET}.") from None
    known = onnx.defs.onnx_opset_version()
    if opset > known:
        raise ModelError(f"{where} uses opset {opset}, which does not exist (the newest ONNX opset this onnx "
                         f"{onnx.__version__} knows is {known}); supported opsets are {MIN_OPSET}..{MAX_OPSET}")
    if opset > MAX_OPSET:
        changed = sorted({n.op_type for n in proto.graph.node
                          if n.domain in DEFAULT_DOMAINS and _changed_after_max(n.op_type, opset)})
        if not changed:
            return proto
        raise ModelError(f"{where} uses opset {opset}; supported opsets are {MIN_OPSET}..{MAX_OPSET}, and these "
                         f"ops changed after opset {MAX_OPSET}: {', '.join(changed)}. Export with opset "
                         f"{MAX_OPSET} or lower (e.g. torch.onnx.export(..., opset_version={MAX_OPSET})).")
    raise ModelError(f"{where} uses opset {opset}; supported opsets are {MIN_OPSET}..{MAX_OPSET} "
                     f"({MIN_UPGRADABLE_OPSET}..{MIN_OPSET - 1} are upgraded automatically).")


def _changed_after_max(op_type: str, opset: int) -> bool:
    """Whether the op's definition at `opset` differs from opset 21 in more than its type
    lists (opset 22, for one, only added bfloat16 to many ops)."""
    try:
        new, old = onnx.defs.get_schema(op_type, opset), onnx.defs.get_schema(op_type, MAX_OPSET)
    except Exception:  # unknown op: let the converter table report it
        return False
    if op_type in READ_AFTER_MAX:
        return False
    if new.since_version == old.since_version:
        return False
    return _signature(new) != _signature(old)


def _signature(schema):
    params = lambda ps: [(p.name, p.option, p.is_homogeneous) for p in ps]  # noqa: E731
    attrs = sorted((a.name, a.type, a.required, a.default_value.SerializeToString())
                   for a in schema.attributes.values())
    return params(schema.inputs), params(schema.outputs), attrs


def _fix_input_shapes(proto: onnx.ModelProto, shapes: dict, where: str, weights=frozenset()) -> None:
    g = proto.graph
    inits = {t.name for t in g.initializer} | set(weights)
    inputs = {vi.name: vi for vi in g.input if vi.name not in inits}
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise ModelError(f"shapes given for unknown input(s) {unknown}; the inputs of {where} are {sorted(inputs)}")
    symbols = _bind_symbols(inputs, shapes, where)
    for name, vi in inputs.items():
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"input '{name}' of {where} is not a tensor; only tensor inputs are supported")
        dims = vi.type.tensor_type.shape.dim
        if name in shapes:
            want = tuple(int(d) for d in shapes[name])
            if vi.type.tensor_type.HasField("shape") and len(dims) != len(want):
                raise ModelError(f"input '{name}' has rank {len(dims)} (shape {_fmt(dims)}) but shapes gives {want}")
            for d, w in zip(dims, want):
                if d.HasField("dim_value") and d.dim_value != w:
                    raise ModelError(f"input '{name}' has static shape {_fmt(dims)} but shapes gives {want}")
            vi.type.tensor_type.shape.Clear()
            for w in want:
                vi.type.tensor_type.shape.dim.add().dim_value = w
            continue
        for d in dims:   # a symbol bound through another input's shape
            if not d.HasField("dim_value") and d.dim_param in symbols:
                d.dim_value = symbols[d.dim_param][0]
        if not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
            shown = _fmt(dims) if vi.type.tensor_type.HasField("shape") else "(unknown rank)"
            parts = [str(d.dim_value) if d.HasField("dim_value") else "N" for d in dims] or ["N"]
            example = "x".join(parts)
            py = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
            raise ModelError(
                f"input '{name}' of {where} has a dynamic shape {shown}; give a static one, in Python "
                f"shapes={{'{name}': {py}}} or on the command line "
                f"--shapes {name}:{example} (replace each symbolic N by a number)")


def _bind_symbols(inputs: dict, shapes: dict, where: str) -> dict[str, tuple[int, str]]:
    """Symbolic dims (dim_param) bound by the given shapes: symbol -> (value, 'input:shape' that
    bound it). Inputs share their symbols, so one input's shape binds them for all; a symbol
    bound to two values is a mismatch."""
    bound: dict[str, tuple[int, str]] = {}
    for name, want in shapes.items():
        tt = inputs[name].type.tensor_type
        if not inputs[name].type.HasField("tensor_type") or not tt.HasField("shape") or len(tt.shape.dim) != len(want):
            continue   # reported by the caller
        given = f"{name}:{'x'.join(str(int(w)) for w in want)}"
        for k, (d, w) in enumerate(zip(tt.shape.dim, want)):
            if d.HasField("dim_value") or not d.dim_param:
                continue
            if d.dim_param in bound and bound[d.dim_param][0] != int(w):
                value, other = bound[d.dim_param]
                raise ModelError(f"inconsistent shapes for {where}: symbol '{d.dim_param}' is {value} in {other} "
                                 f"but {int(w)} in {given} (dimension {k} of '{name}'); inputs that share a "
                                 "symbol must agree on its value")
            bound.setdefault(d.dim_param, (int(w), given))
    return bound


def symbol_uses(proto: onnx.ModelProto) -> dict[str, list[tuple[str, int]]]:
    """Each symbolic input dimension -> the (input, dimension) pairs that use it."""
    inits = {t.name for t in proto.graph.initializer}
    uses: dict[str, list[tuple[str, int]]] = {}
    for vi in proto.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            if not d.HasField("dim_value") and d.dim_param:
                uses.setdefault(d.dim_param, []).append((vi.name, k))
    return uses


def _fmt(dims) -> str:
    return "(" + ", ".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in dims) + ")"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
