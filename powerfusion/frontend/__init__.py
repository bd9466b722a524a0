"""ONNX frontend: load, check, infer shapes, fold constants, decompose into basic ops,
and partition into library calls and memory-bound subgraphs."""
from __future__ import annotations

from powerfusion.frontend.basic import BasicGraph, Partition
from powerfusion.frontend.loader import load_model, parse_shapes


def import_model(model, shapes: dict[str, tuple[int, ...]] | None = None) -> BasicGraph:
    """Path, bytes or onnx.ModelProto -> BasicGraph with static shapes."""
    from powerfusion.frontend.converters import convert_graph
    from powerfusion.frontend.fold import fold_constants
    proto = load_model(model, shapes)
    arrays: dict = {}
    proto = fold_constants(proto, arrays)
    return convert_graph(proto, arrays)


def partition(graph: BasicGraph, target: str = "cpu") -> Partition:
    from powerfusion.frontend.partition import partition_graph
    return partition_graph(graph, target)


def run_basic_graph(graph: BasicGraph, feeds: dict):
    from powerfusion.frontend.numpy_exec import run_basic_graph as run
    return run(graph, feeds)


__all__ = ["import_model", "partition", "run_basic_graph", "load_model", "parse_shapes"]
