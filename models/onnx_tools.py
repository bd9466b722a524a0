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
# The folding itself is the frontend's (powerfusion.frontend.fold): one implementation.

def _static_shape(vi: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return None if None in dims else tuple(dims)


def _dedupe_small_constants(g: onnx.GraphProto, max_elements: int = 64) -> None:
    """Points every use of a small constant (Slice bounds, Reshape shapes) at one copy of
    each distinct value; exporters emit one per node."""
    first, alias = {}, {}
    for t in g.initializer:
        v = numpy_helper.to_array(t)
        if v.size <= max_elements:
            alias[t.name] = first.setdefault((v.dtype.str, v.shape, v.tobytes()), t.name)
    outputs = {o.name for o in g.output}
    for node in g.node:
        for i, n in enumerate(node.input):
            if n in alias and n not in outputs:
                node.input[i] = alias[n]
    used = {n for node in g.node for n in node.input} | outputs
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name not in used]):
        del g.initializer[i]


def _check_outputs_produced(model: onnx.ModelProto) -> onnx.ModelProto:
    """A graph output that folded to a constant means the model ignores its inputs."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    produced = {o for n in g.node for o in n.output}
    for out in g.output:
        if out.name not in produced and out.name in inits:
            raise ValueError(f"graph output {out.name!r} is constant; the model is degenerate")
    return model


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """The frontend's folding (local functions inlined, every node on constants and every
    Shape of a statically shaped tensor evaluated, dead nodes dropped), then exporter bulk
    removed: doc strings, module paths, duplicate small constants."""
    from powerfusion.frontend.fold import fold_constants as fold
    from powerfusion.frontend.loader import infer_shapes
    model = fold(infer_shapes(model, "the exported model"))
    for node in model.graph.node:  # exporter stack traces and module paths: bulk, no meaning
        node.doc_string = ""
        del node.metadata_props[:]
    _dedupe_small_constants(model.graph)
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
