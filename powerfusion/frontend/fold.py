"""Constant folding on the ONNX graph, before conversion: the one folding pass of the
project (models/onnx_tools.py uses it too).

Local functions are inlined first. A node whose inputs are all known constants
(initializers, folded outputs) is evaluated and replaced by initializers; Shape/Size of a
tensor with a static inferred shape is a constant too. Folding and shape inference
alternate until nothing changes, so shape arithmetic (Shape -> Gather -> Concat ->
Reshape, Range / Mod / Div of dims, ConstantOfShape, ScatterND into a constant mask,
Where / Equal on constants) disappears and Reshape/Expand/Slice... see constant shape
inputs. Dead nodes and unused initializers are dropped.

Evaluation uses onnx.reference (onnx is our one hard dependency); where the reference
raises, or for ops it is known to get wrong (`REFERENCE_MISHANDLES`), onnxruntime is used
when it is installed. A node neither can evaluate stays, and conversion handles or reports it.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from powerfusion.frontend.evaluate import evaluate_onnxruntime, evaluate_reference
from powerfusion.frontend.loader import infer_shapes
from powerfusion.frontend.onnx_graph import DEFAULT_DOMAINS, default_opset, initializer_arrays

# ops whose output differs from run to run: never folded
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli"}
# GatherElements with indices shaped unlike the data (broadcast-shaped) comes out wrong
REFERENCE_MISHANDLES = {"GatherElements"}


def fold_constants(model: onnx.ModelProto, arrays: dict | None = None) -> onnx.ModelProto:
    """`model` has inferred shapes (loader.load_model). `arrays` (optional) caches initializer
    values by name across rounds and for the caller."""
    arrays = {} if arrays is None else arrays
    if model.functions:
        import onnx.inliner
        model = infer_shapes(onnx.inliner.inline_local_functions(model))
    # old (IR < 4) models list initializers among the inputs; they are constants here
    inits = {t.name for t in model.graph.initializer}
    real = [vi for vi in model.graph.input if vi.name not in inits]
    if len(real) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(real)
    # a round that changes something folds at least one node away, so the node count bounds the
    # rounds; a fixed cap stopped deep models half-way (swin_s: one round per block's shape chain)
    for _ in range(len(model.graph.node) + 1):
        model, changed = _fold_once(model, arrays)
        model = _drop_dead(model)
        if not changed:
            break
        shapes = static_shapes(model)
        if all(o in shapes for n in model.graph.node for o in n.output if o):
            break  # nothing left for another round to learn (re-inference is slow on big weights)
        model = infer_shapes(model)
    return model


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    g = model.graph
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
    for t in g.initializer:
        out[t.name] = tuple(t.dims)
    return out


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    out = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)
           if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    out.update({t.name: t.data_type for t in g.initializer})
    return out


def _fold_once(model, arrays):
    g = model.graph
    opset = default_opset(model)
    consts = initializer_arrays(model, arrays)
    shapes = static_shapes(model)
    dtypes = elem_types(model)
    kept, changed = [], False
    for node in g.node:
        values = _try_fold(node, consts, shapes, dtypes, opset)
        if values is None:
            kept.append(node)
            continue
        changed = True
        for name, v in zip(node.output, values):
            if name:
                consts[name] = arrays[name] = np.asarray(v)
    if not changed:
        return model, False
    used = {i for n in kept for i in n.input} | {o.name for o in g.output}
    old = {t.name for t in g.initializer}
    del g.node[:]
    g.node.extend(kept)
    _drop_initializers(g, used)
    g.initializer.extend(numpy_helper.from_array(v, name) for name, v in consts.items()
                         if name in used and name not in old)
    # stale value_info of folded tensors would conflict with the initializers' types
    keep_vi = [vi for vi in g.value_info if vi.name not in consts]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    return model, True


def _try_fold(node, consts, shapes, dtypes, opset):
    if node.domain not in DEFAULT_DOMAINS or node.op_type in NONDETERMINISTIC:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
        shape = shapes[node.input[0]]
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", None)
        return [np.array(shape[slice(start, end)], dtype=np.int64)]
    if node.op_type == "CastLike" and node.input[0] in consts and node.input[1] in dtypes:
        # the target only lends its element type: known from inference, whatever its values
        node = onnx.helper.make_node("Cast", [node.input[0]], list(node.output), to=dtypes[node.input[1]],
                                     **{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
    if not all(i == "" or i in consts for i in node.input):
        return None
    if node.op_type == "Constant":
        value = constant_value(node)
        if value is not None:
            return [value]
    feeds = {i: consts[i] for i in node.input if i}
    evaluators = ((evaluate_onnxruntime, evaluate_reference) if node.op_type in REFERENCE_MISHANDLES
                  else (evaluate_reference, evaluate_onnxruntime))
    for evaluate in evaluators:
        try:
            return evaluate(node, feeds, opset)
        except Exception:
            continue
    # neither evaluator takes the op or the values: the node stays, and conversion
    # either handles it or reports it (UnsupportedOpError / NodeError) with the others
    return None


def constant_value(node) -> np.ndarray | None:
    """A Constant node's tensor `value` as onnx.reference gives it (numpy_helper.to_array of the
    attribute, which is all its Constant op does), without building a one-node model and an
    evaluator for it: exported models hold thousands (Swin-T: 2,653, half of the nodes folded).
    None for any other form (value_float, sparse_value, a function's referenced attribute):
    those go through the evaluators."""
    if len(node.attribute) != 1:
        return None
    a = node.attribute[0]
    if a.name != "value" or a.type != onnx.AttributeProto.TENSOR or a.ref_attr_name:
        return None
    try:
        return numpy_helper.to_array(a.t)
    except Exception:   # external data, an unknown type: the evaluators decide
        return None


def _drop_dead(model):
    g = model.graph
    live = {o.name for o in g.output}
    kept = []
    for node in reversed(g.node):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(i for i in node.input if i)
    kept.reverse()
    if len(kept) != len(g.node):
        del g.node[:]
        g.node.extend(kept)
    _drop_initializers(g, live)
    return model


def _drop_initializers(g, keep: set[str]) -> None:
    # delete in place: rebuilding the list would copy every weight
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name not in keep]):
        del g.initializer[i]
