"""ONNX frontend: load, check, infer shapes, fold constants, decompose into basic ops,
and partition into library calls and memory-bound subgraphs.

Its modules import one another in one direction only, each at file level (README.md lists the
order; tests/unit/test_layering.py keeps it)."""
from __future__ import annotations

from powerfusion.basic import BasicGraph
from powerfusion.frontend.converters import CONVERTERS, convert_graph
from powerfusion.frontend.expand import expand_functions
from powerfusion.frontend.fallback import check_fallback
from powerfusion.frontend.fold import fold_constants
from powerfusion.frontend.loader import infer_shapes, load_model, parse_shapes
from powerfusion.frontend.numpy_exec import run_basic_graph
from powerfusion.frontend.partition import partition_graph
from powerfusion.frontend.quantized import fuse_dequantize_matmul
from powerfusion.precision.integer_gemm import fuse_qdq_integer
from powerfusion.precision.qdq import has_quantized_ops, lower_quantized_ops


def import_model(model, shapes: dict[str, tuple[int, ...]] | None = None, fallback: str | None = None) -> BasicGraph:
    """Path, bytes or onnx.ModelProto -> BasicGraph with static shapes. `fallback`
    ('onnxruntime'): unsupported nodes run through onnxruntime on the CPU (a FallbackWarning
    names them) instead of raising UnsupportedOpError."""
    check_fallback(fallback)
    sources: list[str] = []
    proto = load_model(model, shapes, sources=sources)
    proto = fuse_qdq_integer(proto)        # int8 x int8 GEMMs, before the next takes their weights
    proto = fuse_dequantize_matmul(proto)  # before folding would make the weight float
    proto = _lower_quantized(proto)        # QDQ / QLinear* / *Integer -> standard ops
    proto = expand_functions(proto, set(CONVERTERS))  # ops ONNX defines by a function body
    arrays: dict = {}
    proto = fold_constants(proto, arrays)
    graph = convert_graph(proto, arrays, fallback)
    graph.metadata["external_data"] = sources
    return graph


def _lower_quantized(proto):
    """Quantised ops lowered to standard ones (precision/qdq.py), and the new tensors' shapes inferred."""
    if not has_quantized_ops(proto):
        return proto
    return infer_shapes(lower_quantized_ops(proto))


__all__ = ["import_model", "partition_graph", "run_basic_graph", "load_model", "parse_shapes"]
