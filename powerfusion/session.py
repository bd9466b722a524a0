"""`InferenceSession`: run an ONNX model through PowerFusion, with onnxruntime's API.

    sess = InferenceSession("model.onnx")            # target "cpu" by default
    [y] = sess.run(None, {"x": x})

The model is imported to basic ops and partitioned once, at construction. On the CPU
target every memory-bound subgraph is also lowered to GIR and rewritten then (backends/cpu/session.py),
and the partition runs step by step: library calls (MatMul, Conv) through numpy
(TypedMatMul through ttile's MatMulNBits reference / an ONNX DequantizeLinear),
memory-bound subgraphs through their rewritten GIR graph on the fast GIR executor
(gir/fastexec.py) -- or, where a subgraph could not be lowered, through the basic-op
executor, with a `BasicFallbackWarning` and the reason in `session.fallbacks`.
`session.subgraph_paths` says which path each subgraph takes. Other targets plug in an
executor built by their backend.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from powerfusion import options as _options
from powerfusion.backends import registry
from powerfusion.errors import FeedError, PowerFusionError
from powerfusion.basic import (BasicGraph, Conv, LibraryCall, MatMul, Partition, Subgraph,
                                        TensorInfo, TypedMatMul)
from powerfusion.backends.cpu.session import BasicFallbackWarning, CpuPlan, compile_cpu_plan  # noqa: F401

# An executor maps feeds (validated, by graph input name) to a dict holding at least
# every graph output; the CPU one returns every tensor it computed.
Executor = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

@dataclass(frozen=True)
class NodeArg:
    """What `get_inputs()` / `get_outputs()` return, as in onnxruntime."""
    name: str
    shape: list[int]
    type: str  # onnxruntime's spelling, e.g. "tensor(float)"


def onnx_type_string(dtype) -> str:
    """numpy dtype -> onnxruntime's type string ("tensor(float)", "tensor(int64)", ...)."""
    name = np.dtype(dtype).name
    name = {"float32": "float", "float64": "double", "str": "string", "object": "string"}.get(name, name)
    return f"tensor({name.replace('_', '')})"


class InferenceSession:
    """Import, partition and prepare `model` (path, bytes or onnx.ModelProto) for `target`.

    `shapes` fixes dynamic input dimensions ({"x": (1, 3, 224, 224)} or "x:1x3x224x224").
    `options` is a dict of settings for this session (see powerfusion.options).
    """

    def __init__(self, model, target: str | None = None, shapes=None, options: Mapping | None = None):
        from powerfusion.frontend import import_model
        from powerfusion.frontend.partition import partition_graph as partition
        from powerfusion.targets.specs import get_target

        self.options = _options.current().replace(**dict(options or {}))
        self.target = target or self.options.target
        entry = registry.backend(get_target(self.target).backend)  # unknown names raise a PowerFusionError
        if entry.runtime is None:
            raise PowerFusionError(
                f"target '{self.target}' ({entry.name}) can be compiled (`powerfusion compile`) but not run "
                f"from Python here; runnable backends: {', '.join(registry.runnable_backends())}")
        if isinstance(model, (bytes, bytearray)):
            import onnx
            model = onnx.load_from_string(bytes(model))
        if isinstance(shapes, str):
            from powerfusion.frontend.loader import parse_shapes
            shapes = parse_shapes(shapes)
        self.graph: BasicGraph = import_model(model, shapes=shapes)
        self.partition: Partition = partition(self.graph, target=self.target)
        self.profile: list[tuple[str, float]] = []  # (step name, seconds) of the last CPU run
        self.cpu_plan: CpuPlan | None = None
        if entry.name != "cpu":
            self._executor: Executor = _runtime_executor(entry, self.partition, self.options)
        else:
            self.cpu_plan = compile_cpu_plan(self.partition)
            self._executor = lambda feeds: execute_partition(self.partition, feeds, self.profile, self.cpu_plan)

    # ---- onnxruntime API --------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(t) for t in self.graph.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(t) for t in self.graph.outputs]

    def get_providers(self) -> list[str]:
        return [f"PowerFusion:{self.target}"]

    def run(self, output_names, input_feed: Mapping[str, np.ndarray], run_options=None) -> list[np.ndarray]:
        """Outputs named by `output_names` (None: all, in the model's order)."""
        names = [t.name for t in self.graph.outputs] if output_names is None else list(output_names)
        known = {t.name for t in self.graph.outputs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise PowerFusionError(f"unknown output name(s) {unknown}; the model's outputs are {sorted(known)}")
        feeds = self.validate_feeds(input_feed)
        env = self._executor(feeds)
        return [_own_array(env[n], self.graph.constants, feeds) for n in names]

    # ---- beyond onnxruntime -----------------------------------------------------

    @property
    def subgraph_paths(self) -> dict[str, str]:
        """Subgraph name -> "gir" (rewritten GIR on the fast executor) or "basic" (fallback)."""
        return {} if self.cpu_plan is None else self.cpu_plan.paths

    @property
    def fallbacks(self) -> dict[str, str]:
        """Subgraph name -> why it runs on the basic-op executor (empty when every one runs as GIR)."""
        return {} if self.cpu_plan is None else self.cpu_plan.fallbacks

    def run_all_tensors(self, input_feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the CPU run computes, by name (for per-subgraph comparison)."""
        if get_target_backend(self.target) != "cpu":
            raise PowerFusionError("run_all_tensors needs the cpu target")
        return execute_partition(self.partition, self.validate_feeds(input_feed), self.profile, self.cpu_plan)

    def validate_feeds(self, input_feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check names, shapes and dtypes of the feeds; a FeedError names the input and both sides."""
        if not isinstance(input_feed, Mapping):
            raise FeedError(f"input_feed must be a dict of input name -> array, given {type(input_feed).__name__}; "
                            f"expected inputs: " + ", ".join(_describe(t) for t in self.graph.inputs))
        expected = {t.name: t for t in self.graph.inputs}
        unknown = sorted(set(input_feed) - set(expected))
        missing = [n for n in expected if n not in input_feed]
        if unknown or missing:
            raise FeedError(f"feeds do not match the model's inputs: unknown {unknown}, missing {missing}; "
                            f"expected inputs: " + ", ".join(_describe(t) for t in self.graph.inputs))
        feeds = {}
        for name, info in expected.items():
            value = input_feed[name]
            given = np.asarray(value)
            if given.dtype != np.dtype(info.dtype) or tuple(given.shape) != tuple(info.shape):
                raise FeedError(f"input '{name}': expected shape {tuple(info.shape)} dtype "
                                f"{np.dtype(info.dtype).name}, given shape {tuple(given.shape)} dtype "
                                f"{given.dtype.name}")
            feeds[name] = given
        return feeds


def _own_array(value, constants: dict, feeds: dict) -> np.ndarray:
    """An output the caller may change freely: a copy where it shares memory with one of the
    session's constants (changing it would corrupt later runs) or with a feed."""
    value = np.asarray(value)
    if any(np.may_share_memory(value, np.asarray(c)) for c in (*constants.values(), *feeds.values())):
        return value.copy()
    return value


def get_target_backend(target: str) -> str:
    from powerfusion.targets.specs import get_target
    return get_target(target).backend


def _node_arg(t: TensorInfo) -> NodeArg:
    return NodeArg(t.name, [int(d) for d in t.shape], onnx_type_string(t.dtype))


def _describe(t: TensorInfo) -> str:
    return f"'{t.name}' {tuple(t.shape)} {np.dtype(t.dtype).name}"


def _runtime_executor(entry, partition: Partition, opts) -> Executor:
    """A GPU backend's registered runtime, `make_executor(partition, options) -> Executor`; its
    dependencies (a GPU library such as CuPy) are optional installs."""
    try:
        make_executor = entry.load_runtime()
    except ImportError as e:
        raise PowerFusionError(
            f"the {entry.name} target is not available here ({e}). It needs {entry.requires}; "
            "use target='cpu' otherwise.") from None
    return make_executor(partition, opts)


# ---- the CPU executor -------------------------------------------------------------

def execute_partition(partition: Partition, feeds: dict[str, np.ndarray],
                      profile: list | None = None, plan: "CpuPlan | None" = None) -> dict[str, np.ndarray]:
    """Run every step in order; returns every tensor (constants, feeds, intermediates, outputs).
    Memory-bound subgraphs run as `plan` compiled them; without a plan, on the basic-op executor."""
    graph = partition.graph
    env: dict[str, np.ndarray] = dict(graph.constants)
    env.update(feeds)
    if profile is not None:
        profile.clear()
    from powerfusion.frontend.index_check import check_gathers, gather_nodes
    for step in partition.steps:
        start = time.perf_counter()
        check_gathers(gather_nodes(step.nodes if isinstance(step, Subgraph) else [step.node]), env, graph.tensors)
        if isinstance(step, LibraryCall):
            node = step.node
            out = graph.tensors[node.outputs[0]]
            env[out.name] = run_library_op(node.op, [env[i] for i in node.inputs], out.dtype)
        elif plan is not None:
            plan.run(step, env, graph)
        else:
            execute_subgraph(step, env, graph)
        if profile is not None:
            profile.append((step.name if isinstance(step, Subgraph) else step.node.name,
                            time.perf_counter() - start))
    return env


def execute_subgraph(subgraph: Subgraph, env: dict[str, np.ndarray], graph: BasicGraph) -> None:
    """Run one memory-bound subgraph on the basic-op executor (the fallback where a subgraph
    cannot be lowered to GIR), adding its outputs to `env`."""
    from powerfusion.frontend.numpy_exec import run_basic_graph

    sub = BasicGraph(name=subgraph.name,
                     inputs=[graph.tensors[n] for n in subgraph.inputs],
                     outputs=[graph.tensors[n] for n in subgraph.outputs],
                     tensors=graph.tensors, constants={}, nodes=list(subgraph.nodes), opset=graph.opset)
    results = run_basic_graph(sub, {n: env[n] for n in subgraph.inputs})
    for n in subgraph.outputs:
        env[n] = results[n]


# ---- library ops through numpy ------------------------------------------------------

def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half types accumulate in float32 (as cuBLAS/cuDNN do); wider types stay as they are."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize < 4 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def run_library_op(op, inputs: list[np.ndarray], out_dtype) -> np.ndarray:
    if isinstance(op, TypedMatMul):  # low-bit constants: not cast to the compute dtype
        from powerfusion.frontend.quantized import run_typed_matmul
        return run_typed_matmul(op, inputs, out_dtype)
    work = _compute_dtype(inputs[0].dtype)
    args = [np.asarray(x).astype(work, copy=False) for x in inputs]
    if isinstance(op, MatMul):
        a, b = args
        if op.trans_a:
            a = np.swapaxes(a, -1, -2)
        if op.trans_b:
            b = np.swapaxes(b, -1, -2)
        y = np.matmul(a, b)
    elif isinstance(op, Conv):
        y = conv_nd(args[0], args[1], args[2] if len(args) > 2 else None, op)
    else:
        raise PowerFusionError(f"no CPU implementation for library op {type(op).__name__}")
    return np.asarray(y).astype(out_dtype, copy=False)


def conv_nd(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, op: Conv) -> np.ndarray:
    """ONNX Conv (1-3 spatial dims, grouped, strided, dilated) as im2col + one batched matmul."""
    nsp = x.ndim - 2
    n, c = x.shape[:2]
    m, kernel = w.shape[0], w.shape[2:]
    g = op.group
    if c % g or m % g or w.shape[1] * g != c:
        raise PowerFusionError(f"Conv: input channels {c}, weight {w.shape} and group {g} do not agree")
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(op.pad_begins, op.pad_ends)))
    out_sp = tuple((size - (k - 1) * d - 1) // st + 1
                   for size, k, d, st in zip(xp.shape[2:], kernel, op.dilations, op.strides))
    taps = int(np.prod(kernel, dtype=np.int64))
    positions = int(np.prod(out_sp, dtype=np.int64))
    # im2col as one strided block copy per kernel tap: cols[c, tap, n, *out]
    cols = np.empty((c, taps, n) + out_sp, dtype=x.dtype)
    for t, k in enumerate(np.ndindex(*kernel)):
        window = tuple(slice(ki * d, ki * d + (o - 1) * st + 1, st)
                       for ki, d, st, o in zip(k, op.dilations, op.strides, out_sp))
        cols[:, t] = xp[(slice(None), slice(None)) + window].swapaxes(0, 1)
    # channels are group-major, so this is [g, C/g * taps, N * positions] without a copy;
    # W[g] (M/g x C/g*taps) @ cols[g] lands in channel-major order
    cols = cols.reshape(g, (c // g) * taps, n * positions)
    y = np.matmul(w.reshape(g, m // g, (c // g) * taps), cols)   # [g, M/g, N*positions]
    y = y.reshape((g, m // g, n) + out_sp)
    y = np.moveaxis(y, 2, 0).reshape((n, m) + out_sp)             # [N, M, *out]
    if b is not None:
        y = y + b.reshape((1, m) + (1,) * nsp)
    return y
