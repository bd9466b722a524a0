"""Graph clean-up and checks for exported models (onnx + numpy only, no torch).

Exporters leave shape arithmetic (Shape -> Gather -> Concat -> Reshape), mask
construction (Range, Trilu, CumSum) and weight transposes in the graph. With
static input shapes all of that is constant, so it is evaluated here once and
stored as initializers; what remains is the model's real data flow.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.inliner
from onnx import helper, numpy_helper, shape_inference

# Op types the PowerFusion frontend accepts; every bundled model stays inside this set.
FRONTEND_OPS = frozenset("""
Add Sub Mul Div Pow Sqrt Reciprocal Neg Abs Exp Log Erf Tanh Sigmoid Relu LeakyRelu Clip
HardSigmoid HardSwish Gelu Softmax LogSoftmax LayerNormalization BatchNormalization
InstanceNormalization ReduceMean ReduceSum ReduceMax ReduceMin Transpose Reshape Flatten
Squeeze Unsqueeze Concat Split Slice Gather Expand Where Cast Equal Less Greater Not And Or
Sum Max Min Identity Dropout Constant ConstantOfShape Shape Pad MatMul Gemm Conv MaxPool
AveragePool GlobalAveragePool IsNaN GatherElements LessOrEqual GreaterOrEqual
""".split())

# Never evaluated at build time even when their inputs are constant.
_NOT_FOLDABLE = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                           "RandomUniformLike", "Multinomial", "Bernoulli"})

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64,
              "int32": np.int32, "bool": np.bool_}


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: static shape, dtype name, and for integer inputs the
    inclusive range of values the model is meant to see (token ids, masks)."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    low: int | None = None
    high: int | None = None

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.low is not None:
            out["range"] = [self.low, self.high]
        return out

    @staticmethod
    def from_json(d: dict) -> "TensorSpec":
        low, high = d.get("range", (None, None))
        return TensorSpec(d["name"], tuple(d["shape"]), d["dtype"], low, high)


def sample_inputs(specs, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds: integers uniform over their range, floats standard normal."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in specs:
        dtype = _NP_DTYPES[s.dtype]
        if s.low is not None:
            feeds[s.name] = rng.integers(s.low, s.high + 1, size=s.shape).astype(dtype)
        else:
            feeds[s.name] = rng.standard_normal(s.shape).astype(dtype)
    return feeds


# ---- constant folding ------------------------------------------------------------

def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {o.domain: o.version for o in model.opset_import}


def _static_shape(vi: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return None if None in dims else tuple(dims)


def _known_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    g = inferred.graph
    shapes = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        s = _static_shape(vi)
        if s is not None:
            shapes[vi.name] = s
    return shapes


def _fold_shape(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.array(shape[slice(start, end)], dtype=np.int64)


def _evaluate(node: onnx.NodeProto, values: dict, opsets: dict) -> list[np.ndarray]:
    """Runs one node in onnxruntime (the onnx reference evaluator mishandles some ops,
    e.g. GatherElements with broadcast-shaped indices)."""
    import onnxruntime as ort
    ins = list(dict.fromkeys(n for n in node.input if n))
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(values[n].dtype),
                                            values[n].shape) for n in ins]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = 8  # any version onnxruntime reads; opsets carry the semantics
    model = shape_inference.infer_shapes(model, strict_mode=True)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    result = dict(zip([o.name for o in outputs], sess.run(None, {n: values[n] for n in ins})))
    return [np.asarray(result[o]) if o else None for o in node.output]


def _fold_pass(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    g = model.graph
    opsets = _opsets(model)
    shapes = _known_shapes(model)
    values = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    kept, changed = [], False
    for node in g.node:
        if node.op_type == "Constant":
            values[node.output[0]] = _evaluate(node, values, opsets)[0]
            changed = True
        elif node.op_type == "Shape" and node.input[0] in shapes:
            values[node.output[0]] = _fold_shape(node, shapes[node.input[0]])
            changed = True
        elif (node.domain in ("", "ai.onnx") and node.op_type not in _NOT_FOLDABLE
              and all(n in values for n in node.input if n)):
            for name, v in zip(node.output, _evaluate(node, values, opsets)):
                if name:
                    values[name] = v
            changed = True
        else:
            kept.append(node)
    return _rebuild(model, kept, values), changed


def _live_nodes(graph_outputs, nodes) -> list:
    needed = {o.name for o in graph_outputs}
    live = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(n for n in node.input if n)
    return live[::-1]


def _dedupe_small_constants(nodes, values, keep: set, max_elements: int = 64) -> None:
    """Points every use of a small constant (Slice bounds, Reshape shapes) at one copy of
    each distinct value; exporters emit one per node."""
    first, alias = {}, {}
    for name, v in values.items():
        if v is not None and v.size <= max_elements and name not in keep:
            key = (v.dtype.str, v.shape, v.tobytes())
            alias[name] = first.setdefault(key, name)
    for node in nodes:
        for i, n in enumerate(node.input):
            if n in alias:
                node.input[i] = alias[n]


def _rebuild(model, nodes, values) -> onnx.ModelProto:
    g = model.graph
    nodes = _live_nodes(g.output, nodes)
    for node in nodes:  # exporter stack traces and module paths: bulk, no meaning
        node.doc_string = ""
        del node.metadata_props[:]
    graph_inputs = {i.name for i in g.input}
    _dedupe_small_constants(nodes, values, graph_inputs)
    used = {n for node in nodes for n in node.input} | {o.name for o in g.output}
    inits = [numpy_helper.from_array(np.asarray(values[n], order="C"), n)
             for n in sorted(used) if n in values and n not in graph_inputs]
    new_graph = helper.make_graph(nodes, g.name, list(g.input), list(g.output), inits)
    out = helper.make_model(new_graph, opset_imports=list(model.opset_import),
                            producer_name=model.producer_name or "powerfusion-models")
    out.ir_version = model.ir_version
    return out


def _check_outputs_produced(model: onnx.ModelProto) -> onnx.ModelProto:
    """A graph output that folded to a constant means the model ignores its inputs."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    produced = {o for n in g.node for o in n.output}
    for out in g.output:
        if out.name not in produced and out.name in inits:
            raise ValueError(f"graph output {out.name!r} is constant; the model is degenerate")
    return model


def fold_constants(model: onnx.ModelProto, max_passes: int = 10) -> onnx.ModelProto:
    """Inline functions, then evaluate every node whose inputs are all constant (and every
    Shape of a statically shaped tensor) until nothing changes; drop dead nodes."""
    model = onnx.inliner.inline_local_functions(model)
    for _ in range(max_passes):
        model, changed = _fold_pass(model)
        if not changed:
            break
    return _check_outputs_produced(infer_static_shapes(model))


# ---- checks ----------------------------------------------------------------------

def infer_static_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference that records a value_info for every intermediate tensor."""
    del model.graph.value_info[:]
    return shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def dynamic_tensors(model: onnx.ModelProto) -> list[str]:
    """Names of tensors (inputs, outputs, intermediates) whose shape is not fully static."""
    g = model.graph
    known = {vi.name: _static_shape(vi) for vi in list(g.input) + list(g.value_info) + list(g.output)}
    inits = {i.name for i in g.initializer}
    names = [o for n in g.node for o in n.output if o] + [i.name for i in g.input]
    return [n for n in names if n not in inits and known.get(n) is None]


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    return sorted({n.op_type for n in model.graph.node
                   if n.op_type not in FRONTEND_OPS or n.domain not in ("", "ai.onnx")})


def initializer_elements(model: onnx.ModelProto) -> int:
    return int(sum(int(np.prod(i.dims, dtype=np.int64)) for i in model.graph.initializer))


def graph_specs(model: onnx.ModelProto, which: str) -> list[TensorSpec]:
    """TensorSpecs (without ranges) of the graph's inputs or outputs."""
    out = []
    for vi in getattr(model.graph, which):
        elem = vi.type.tensor_type.elem_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem)).name
        out.append(TensorSpec(vi.name, _static_shape(vi), dtype))
    return out


def run_onnxruntime(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    import onnxruntime as ort  # test-time dependency only
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))
