"""User-facing errors. Every error that a model or a feed can cause is one of these,
and its message names the node, op type, opset and shapes involved."""
from __future__ import annotations


class PowerFusionError(Exception):
    """Base class: the CLI prints these as one paragraph, without a traceback."""


class ModelError(PowerFusionError):
    """The model file is malformed, fails onnx.checker, or has a dynamic dimension."""


class UnsupportedOpError(PowerFusionError):
    """One or more nodes use an op (or an attribute value) we do not compile."""

    def __init__(self, nodes: list[tuple[str, str, int, str]]):
        # nodes: (node name, op type, opset, reason or shapes)
        self.nodes = nodes
        counts: dict[str, int] = {}
        for _, op, _, _ in nodes:
            counts[op] = counts.get(op, 0) + 1
        by_type = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        lines = [f"  - node '{n}' ({op}, opset {opset}): {why}" for n, op, opset, why in nodes]
        super().__init__(f"{len(nodes)} unsupported node(s) of {len(counts)} op type(s): {by_type}\n"
                         + "\n".join(lines))


class NodeError(PowerFusionError):
    """A node cannot be converted: bad attribute values or shapes."""

    def __init__(self, node: str, op_type: str, opset: int, shapes, message: str):
        self.node, self.op_type, self.opset, self.shapes = node, op_type, opset, shapes
        super().__init__(f"node '{node}' ({op_type}, opset {opset}, input shapes {shapes}): {message}")


class FeedError(PowerFusionError):
    """An input feed has the wrong name, shape or dtype."""


class CompileError(PowerFusionError):
    """A backend compiler rejected emitted source (a bug in PowerFusion, reported with the source path)."""


class DataError(PowerFusionError):
    """A run's data is outside what an op accepts (an index out of range, an integer division
    by zero), where onnxruntime refuses too: never a silently wrong value."""


class CacheWarning(UserWarning):
    """A cache folder could not be read or written; the run goes on without it."""


_CACHE_WARNED: set[str] = set()


def cache_unusable(what: str, path, error: BaseException) -> None:
    """Warn once per process that a cache (under `path`) is skipped, with the reason: a cache
    folder that is a file, read-only or on a full disk costs speed only, never the run."""
    import warnings
    if _CACHE_WARNED:
        return
    _CACHE_WARNED.add(what)
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    warnings.warn(f"the {what} cache at {path} cannot be used ({reason}); carrying on without caching",
                  CacheWarning, stacklevel=3)


def reset_cache_warnings() -> None:
    """Forget earlier cache warnings (tests)."""
    _CACHE_WARNED.clear()
