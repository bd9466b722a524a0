"""Helpers shared by the subcommands: model and shape arguments, inputs, progress, tolerances."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from powerfusion import options
from powerfusion.errors import FeedError, PowerFusionError

# Tolerances of `compare` (|ours - reference| <= atol + rtol * |reference|, elementwise),
# per output dtype. float32 follows the ONNX backend tests' default rtol; integer and
# boolean outputs must match exactly.
TOLERANCES: dict[str, tuple[float, float]] = {   # dtype -> (rtol, atol)
    "float64": (1e-7, 1e-9),
    "float32": (1e-3, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}
INT_RANGE = (0, 8)  # random integer inputs, unless an input indexes a Gather (then [0, axis size))


def add_model_arguments(p: argparse.ArgumentParser, target: bool = True) -> None:
    p.add_argument("model", help="path of an .onnx file")
    p.add_argument("--shapes", help="static shapes of dynamic inputs, e.g. 'x:1x3x224x224,ids:1x128'")
    if target:
        p.add_argument("--target", default=None,
                       help="cpu (default), cuda, hip, mlu or a device name (a100, h100, h200, mi100, mi250, mlu370)")


def add_fp32_matmul_argument(p: argparse.ArgumentParser) -> None:
    from powerfusion.options import FP32_MATMUL_MODES
    p.add_argument("--fp32-matmul", choices=FP32_MATMUL_MODES, default=None, metavar="MODE",
                   help="cuda target: fp32 MatMul / Gemm / Conv as exact SGEMM ('fp32', the default) or "
                        "emulated on tensor cores by Ape ('auto', 'fp32-f', 'fp32-t', 'fp32-b'; docs/ape.md); "
                        "the cpu target ignores it")


def flag_options(args) -> dict:
    """The InferenceSession options set by a command's flags (--fp32-matmul)."""
    mode = getattr(args, "fp32_matmul", None)
    return {} if mode is None else {"fp32_matmul": mode}


def progress(message: str) -> None:
    if options.current().verbose >= 1:
        print(f"[powerfusion] {message}", file=sys.stderr, flush=True)


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def check_model_path(path: str) -> str:
    from powerfusion import demo
    path = demo.resolve(path)
    if not os.path.exists(path):
        from powerfusion import demo
        raise PowerFusionError(f"model file '{path}' does not exist (bundled models, usable by name: "
                               f"{', '.join(demo.names())})")
    if os.path.isdir(path):
        raise PowerFusionError(f"'{path}' is a directory; give the path of an .onnx file")
    return path


def load_model(path: str):
    """(resolved path, ModelProto) of a model argument; an unreadable file is a PowerFusionError."""
    import onnx
    path = check_model_path(path)
    try:
        return path, onnx.load(path)
    except Exception as e:
        raise PowerFusionError(f"'{path}' is not a readable ONNX model ({e})") from None


def parse_shapes(text: str | None):
    if not text:
        return None
    from powerfusion.frontend.loader import parse_shapes as parse
    return parse(text)


def make_session(args, target: str | None = None, session_options: dict | None = None):
    """The session for `args.model`: an .onnx file, or a folder `compile -o` wrote (cuda)."""
    from powerfusion.session import InferenceSession
    target = target or getattr(args, "target", None)
    if os.path.isdir(args.model) and target is None:
        target = "cuda"   # a compiled folder holds CUDA kernels
    elif not os.path.isdir(args.model):
        args.model = check_model_path(args.model)
    progress(f"importing and partitioning {args.model}")
    with Timer() as t:
        fallback = getattr(args, "fallback", None)
        if fallback:
            session_options = {**(session_options or {}), "fallback": fallback}
        sess = InferenceSession(args.model, target=target, shapes=parse_shapes(args.shapes),
                                options={**flag_options(args), **(session_options or {})})
    if sess.partition is not None:
        progress(f"prepared in {t.seconds:.2f} s: {len(sess.partition.library_calls)} library calls, "
                 f"{len(sess.partition.subgraphs)} memory-bound subgraphs")
    else:
        progress(f"loaded the compiled folder in {t.seconds:.2f} s")
    return sess


def load_or_make_inputs(sess, inputs_path: str | None, seed: int) -> dict[str, np.ndarray]:
    if inputs_path:
        if not os.path.exists(inputs_path):
            raise PowerFusionError(f"inputs file '{inputs_path}' does not exist")
        try:
            with np.load(inputs_path, allow_pickle=False) as data:
                feeds = {k: data[k] for k in data.files}
        except (ValueError, OSError) as e:
            raise FeedError(f"'{inputs_path}' is not a readable .npz file: {e}") from None
        sess.validate_feeds(feeds)
        return feeds
    return random_inputs(sess.graph, seed)


def random_inputs(graph, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs: floats standard normal, integers in a range safe for indexing, booleans fair."""
    rng = np.random.default_rng(seed)
    bounds = gather_bounds(graph)
    feeds = {}
    for t in graph.inputs:
        dtype = np.dtype(t.dtype)
        if dtype == np.bool_:
            feeds[t.name] = rng.random(t.shape) < 0.5
        elif dtype.kind in "iu":
            low, high = INT_RANGE
            high = min(high, bounds.get(t.name, high))
            feeds[t.name] = rng.integers(low, max(high, low + 1), size=t.shape).astype(dtype)
        else:
            feeds[t.name] = rng.standard_normal(t.shape).astype(dtype)
    return feeds


def gather_bounds(graph) -> dict[str, int]:
    """For inputs used (directly or through elementwise casts) as Gather indices: the axis size."""
    from powerfusion.basic import Elementwise, Gather
    consumers = graph.consumers()
    bounds: dict[str, int] = {}
    for t in graph.inputs:
        frontier, seen = [t.name], set()
        while frontier:
            name = frontier.pop()
            seen.add(name)
            for node in consumers.get(name, []):
                if isinstance(node.op, Gather) and node.inputs[1] == name:
                    size = graph.tensors[node.inputs[0]].shape[node.op.axis]
                    bounds[t.name] = min(bounds.get(t.name, size), size)
                elif isinstance(node.op, Elementwise) and len(node.inputs) == 1 and node.outputs[0] not in seen:
                    frontier.append(node.outputs[0])
    return bounds


def summarize(name: str, value: np.ndarray) -> str:
    v = np.asarray(value)
    head = f"{name}: shape {tuple(v.shape)} {v.dtype.name}"
    if v.size == 0:
        return head + " (empty)"
    if v.dtype.kind in "fiub" or v.dtype.name == "bfloat16":
        f = v.astype(np.float64)
        finite = f[np.isfinite(f)]
        stats = (f"min {finite.min():.6g} max {finite.max():.6g} mean {finite.mean():.6g}"
                 if finite.size else "no finite values")
        nonfinite = f.size - finite.size
        first = np.array2string(v.reshape(-1)[:6], precision=5, separator=", ")
        return f"{head}  {stats}" + (f"  ({nonfinite} non-finite)" if nonfinite else "") + f"  first {first}"
    return head
