"""Convolution through cuDNN's graph API, by NVIDIA's Python frontend (`nvidia-cudnn-frontend`,
imported as `cudnn`; the libraries come from the `nvidia-cudnn-cu13` wheel that torch installs).

Why the frontend and not our own bindings: CuPy 14 ships no cuDNN, and the frontend is NVIDIA's
supported way to the graph API (heuristics, plan building, the engine filters used here) with a
stable Python surface. It is optional: where it does not import, convolutions stay on the
im2col + cuBLAS path of library.py, and the runner reports that in its `fallbacks`.

The route is chosen once when the runner is built (`plan_convs`): each Conv library step gets a
cuDNN graph built for its exact shapes and dtype (cached per shape and device), or the reason it
falls back. Of cuDNN's first TUNE_PLANS heuristic plans the fastest on scratch data is kept (a
few milliseconds per shape), and the runner keeps im2col + cuBLAS instead where that is faster
still: measured on the H200, cuDNN's best strict-fp32 engine for ResNet's 512-channel 7x7 3x3
conv at batch 1 takes 107 us, im2col + SGEMM 24 us (benchmarks/results/conv.md). Execution is
one `cudnnBackendExecute` on the handle's stream with the runner's one planned workspace, so it
is captured in the session's CUDA graph like any kernel.

Numerics: fp16 / bf16 accumulate in fp32 (tensor cores); fp32 engines that use tensor cores are
deselected (they compute in TF32), so fp32 convolutions are as exact as the cuBLAS path (no TF32).

The bias is fused into the graph (`conv_fprop -> bias`) where an engine supports that; else the
conv runs alone and our bias kernel adds it in place. An activation after the conv lives in a GIR
subgraph (the partition decides that), so it is not fused here.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import threading
from dataclasses import dataclass

import numpy as np

# ONNX dtype name -> cudnn.data_type member name
_DTYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16"}
WORKSPACE_LIMIT = 256 << 20   # engines that need more are not considered
TUNE_PLANS = 4    # cuDNN's first heuristic candidates, each timed once at build; the fastest runs
TUNE_CALLS = 10   # calls per candidate in its timed graph


@dataclass(frozen=True, slots=True)
class ConvShape:
    """One convolution as cuDNN sees it: NC* input, M(C/g)* weight (logical dims), one dtype;
    stored row-major, or channels-last (N*C input, M*(C/g) weight, N*M output) where
    `channels_last` (frontend/layout.py)."""
    x: tuple[int, ...]
    w: tuple[int, ...]
    bias: bool
    strides: tuple[int, ...]
    pad_begins: tuple[int, ...]
    pad_ends: tuple[int, ...]
    dilations: tuple[int, ...]
    dtype: str
    channels_last: bool = False

    @property
    def out(self) -> tuple[int, ...]:
        sp = tuple((i + b + e - d * (k - 1) - 1) // s + 1 for i, k, s, b, e, d in zip(
            self.x[2:], self.w[2:], self.strides, self.pad_begins, self.pad_ends, self.dilations))
        return (self.x[0], self.w[0], *sp)

    def as_2d(self) -> "ConvShape":
        """A 1-D convolution as a 2-D one of height one (cuDNN's convolutions start at 2-D)."""
        if len(self.x) != 3:
            return self
        return ConvShape((self.x[0], self.x[1], 1, self.x[2]), (self.w[0], self.w[1], 1, self.w[2]), self.bias,
                         (1, *self.strides), (0, *self.pad_begins), (0, *self.pad_ends), (1, *self.dilations),
                         self.dtype, self.channels_last)


def unsupported_reason(shape: ConvShape) -> str | None:
    """Why cuDNN is not asked for this convolution at all (None: it is asked)."""
    if shape.dtype not in _DTYPES:
        return f"dtype {shape.dtype} (cuDNN is used for {', '.join(_DTYPES)})"
    if not 1 <= len(shape.x) - 2 <= 3:
        return f"{len(shape.x) - 2} spatial dimensions (cuDNN is used for 1 to 3)"
    if any(d <= 0 for d in shape.out):
        return f"empty output {shape.out}"
    return None


def _preload_library() -> None:
    """Load libcudnn.so.9 from the nvidia-cudnn wheels where the frontend's own search (one
    fixed folder of site-packages) would miss it; a library already loaded is found by soname."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", "libcudnn.so.9"))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


@functools.cache
def load():
    """(the `cudnn` module, "") where the frontend imports and finds cuDNN's library, else
    (None, why not). Probed once per process."""
    try:
        _preload_library()
        import cudnn
        version = cudnn.backend_version()
    except Exception as e:   # ImportError, or a frontend that cannot reach libcudnn
        return None, f"cuDNN frontend not usable here ({type(e).__name__}: {str(e).strip()[:200]})"
    if version < 90000:
        return None, f"cuDNN {version} is older than 9.0"
    return cudnn, ""


_LOCK = threading.Lock()        # held while a graph is built (building binds: not this lock)
_BIND_LOCK = threading.Lock()
_BOUND: dict[int, int] = {}   # handle -> the stream it runs on now


def bind_stream(handle_: int, stream_ptr: int) -> None:
    """Queue the handle's later executions on this stream. Called before a capture begins, so
    that inside it (same stream) nothing reaches cudnnSetStream."""
    with _BIND_LOCK:
        if _BOUND.get(handle_) != stream_ptr:
            load()[0].set_stream(handle_, stream_ptr)
            _BOUND[handle_] = stream_ptr


@functools.cache
def handle(device_id: int) -> int:
    """One cuDNN handle per device (made on that device, kept for the process)."""
    import cupy
    cudnn, _ = load()
    with cupy.cuda.Device(device_id):
        return cudnn.create_handle()


class CudnnConv:
    """One convolution's cuDNN graph with its execution plan, built once; `__call__` enqueues
    it on the handle's stream (bound by `bind`).

    With a bias, two graphs are built and timed: conv -> bias fused, and the conv alone followed
    by our bias kernel; the faster is kept. Measured on the H200 (benchmarks/results/conv.md),
    the fused graph of a bf16 1x1 conv at batch 8 took 27 us where torch's conv + separate
    bias add took 12.5 us."""

    def __init__(self, shape: ConvShape, device_id: int):
        self.shape, self.device_id = shape, device_id
        self.handle = handle(device_id)
        variants, failures = [], []
        for fuse in ((True, False) if shape.bias else (False,)):
            try:
                variants.append(_Variant(self, fuse))
            except Exception as e:   # no engine for this graph: the other variant may have one
                failures.append(f"{'conv + bias' if fuse else 'conv'}: {type(e).__name__}: {str(e).strip()[:200]}")
        if not variants:
            raise RuntimeError("; ".join(failures))
        self.variant = min(variants, key=lambda v: v.time_us)
        self.fused_bias = self.variant.fused_bias
        self.plans, self.index, self.times_us = self.variant.plans, self.variant.index, self.variant.times_us
        self.time_us = self.variant.time_us
        self.workspace_bytes = self.variant.workspace(self.index)
        self.plan_name = self.variant.plan_name()
        self.tried = {("conv + bias" if v.fused_bias else "conv, bias kernel"): v.time_us for v in variants}

    def bind(self, stream_ptr: int) -> None:
        bind_stream(self.handle, stream_ptr)

    def __call__(self, x, w, bias, out, workspace) -> None:
        """out = conv(x, w) (+ bias), all CuPy arrays of the planned shapes; `workspace` holds at
        least `workspace_bytes`."""
        self.variant.execute(self.index, x, w, bias, out, workspace)


class _Variant:
    """One cuDNN graph of a convolution (with the bias fused or not), its built plans, each
    timed on scratch data; `index` is the fastest (None: cuDNN's own heuristic choice, built
    by `build_plans` where no plan could be built by index)."""

    def __init__(self, conv: CudnnConv, fused_bias: bool):
        self.conv, self.fused_bias = conv, fused_bias
        self.graph, self.tensors = _graph(conv.shape.as_2d(), fused_bias, conv.handle)
        self.plans = _build_candidates(self.graph)
        self.index, self.times_us = self._tune()
        self.time_us = self.times_us[self.index]

    def workspace(self, index) -> int:
        if index is None:
            return int(self.graph.get_workspace_size())
        return int(self.graph.get_workspace_size_plan_at_index(index))

    def plan_name(self) -> str:
        return "" if self.index is None else _plan_name(self.graph, self.index)

    def _tune(self):
        """Time each built plan on scratch buffers; (the fastest, {plan: us})."""
        import cupy
        x, w, b, y = scratch(self.conv.shape)
        ws = cupy.empty(max([self.workspace(i) for i in self.plans] + [1]), dtype=np.uint8)
        self.conv.bind(cupy.cuda.get_current_stream().ptr)
        times, failures = {}, []
        for i in self.plans:
            try:
                times[i] = time_us(lambda: self.execute(i, x, w, b, y, ws), lambda st: self.conv.bind(st.ptr))
            except Exception as e:   # a plan that built but does not run here is not kept
                failures.append(f"plan {i}: {type(e).__name__}: {str(e)[:100]}")
        if not times:
            raise RuntimeError("no built plan ran: " + "; ".join(failures))
        return min(times, key=times.get), times

    def execute(self, index, x, w, bias, out, workspace) -> None:
        tx, tw, tb, ty = self.tensors
        pack = {tx: x.data.ptr, tw: w.data.ptr, ty: out.data.ptr}
        if tb is not None:
            pack[tb] = bias.data.ptr
        ws = workspace.data.ptr if workspace is not None else 0
        if index is None:
            self.graph.execute(pack, ws, handle=self.conv.handle)
        else:
            self.graph.execute_plan_at_index(pack, ws, index, handle=self.conv.handle)
        if bias is not None and not self.fused_bias:
            add_bias(out, bias, self.conv.shape.dtype, self.conv.shape.channels_last)


def _graph(s: ConvShape, fuse_bias: bool, handle_: int):
    """The cuDNN graph of this (2-D or 3-D) convolution, its operations built and its engine
    candidates listed and filtered; (graph, (x, w, b or None, y) tensors)."""
    cudnn, _ = load()
    io = getattr(cudnn.data_type, _DTYPES[s.dtype])
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle_)
    layout = _channels_last if s.channels_last else _row_major
    x = g.tensor(name="X", dim=list(s.x), stride=layout(s.x), data_type=io)
    w = g.tensor(name="W", dim=list(s.w), stride=layout(s.w), data_type=io)
    y = g.conv_fprop(image=x, weight=w, pre_padding=list(s.pad_begins), post_padding=list(s.pad_ends),
                     stride=list(s.strides), dilation=list(s.dilations), compute_data_type=cudnn.data_type.FLOAT)
    b = None
    if fuse_bias:
        bdim = [1, s.w[0]] + [1] * (len(s.x) - 2)
        b = g.tensor(name="B", dim=bdim, stride=_row_major(bdim), data_type=io)
        y = g.bias(input=y, bias=b)
    y.set_output(True).set_data_type(io).set_dim(list(s.out)).set_stride(layout(s.out))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if s.dtype == "float32":   # tensor-core fp32 engines compute in TF32
        g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])
    g.deselect_workspace_greater_than(WORKSPACE_LIMIT)
    g.check_support()
    return g, (x, w, b, y)


def _build_candidates(graph) -> list:
    """Build the first TUNE_PLANS plans that build, in cuDNN's heuristic order, looking at
    every candidate (for fp32 the filters bar most of the first ones: the tensor-core engines).
    Where none builds by index, cuDNN's own choice (`build_plans`), returned as [None]."""
    built = []
    for i in range(int(graph.get_execution_plan_count())):
        try:
            graph.build_plan_at_index(i)
        except Exception:
            continue
        built.append(i)
        if len(built) == TUNE_PLANS:
            break
    if not built:
        graph.build_plans()
        built = [None]
    return built


def scratch(shape: ConvShape):
    """(x, w, b or None, y) CuPy buffers of this shape holding standard-normal values (bf16 as
    bits), for timing a route on data like a model's (not zeros, which run faster)."""
    import cupy
    rng = cupy.random.RandomState(0)

    def values(dims):
        v = rng.standard_normal(dims, dtype=np.float32)
        if shape.dtype == "bfloat16":
            return (v.view(np.uint32) >> 16).astype(np.uint16)
        return v.astype(shape.dtype)
    return values(shape.x), values(shape.w), values(shape.w[:1]) if shape.bias else None, \
        cupy.empty(shape.out, dtype=np.uint16 if shape.dtype == "bfloat16" else shape.dtype)


def time_us(run, bind=None, calls: int = TUNE_CALLS) -> float:
    """Device microseconds per `run()`, as a session's replay sees it: `calls` runs captured
    in one CUDA graph, replayed between events (`bind(stream)` points the library handles at
    the capture stream first, and at the current one after). Timing single eager calls would
    measure the host's submission (~30 us through the frontend) instead of the GPU's work.
    Where capture fails, eager calls between events."""
    import cupy
    run()   # warm-up, eager: kernels compiled and buffers allocated before any capture
    try:
        per_call = _captured_us(run, bind, calls)
    except Exception:   # capture refused: time eager calls (host submission included)
        per_call = None
    if bind is not None:
        bind(cupy.cuda.get_current_stream())
    if per_call is not None:
        return per_call
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls


def _captured_us(run, bind, calls: int) -> float:
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        if bind is not None:
            bind(stream)
        stream.begin_capture()
        try:
            for _ in range(calls):
                run()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)   # the first replay uploads the graph
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls


def _row_major(dims) -> list[int]:
    strides, step = [], 1
    for d in reversed(list(dims)):
        strides.append(step)
        step *= max(int(d), 1)
    return strides[::-1]


def _channels_last(dims) -> list[int]:
    """Strides of logical dims [N, C, *S] stored as [N, *S, C]."""
    n, c, *spatial = [max(int(d), 1) for d in dims]
    strides, step = [], c
    for d in reversed(spatial):
        strides.append(step)
        step *= d
    return [step, 1, *strides[::-1]]


def _plan_name(graph, index: int) -> str:
    try:
        return str(graph.get_plan_name_at_index(index))
    except Exception:   # older frontends name no plan
        return ""


_CACHE: dict[tuple[ConvShape, int], CudnnConv] = {}


def build(shape: ConvShape, device_id: int) -> CudnnConv:
    """The cuDNN graph for this shape on this device, built on first use and cached."""
    key = (shape, device_id)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = CudnnConv(shape, device_id)
        return _CACHE[key]


def conv_shape(graph, node) -> ConvShape:
    """The ConvShape of a Conv node of a BasicGraph (logical NC* dims for a channels-last one)."""
    op, t = node.op, graph.tensors
    x, w = (tuple(int(d) for d in t[name].shape) for name in node.inputs[:2])
    if op.channels_last:
        x, w = (x[0], x[-1], *x[1:-1]), (w[0], w[-1], *w[1:-1])
    return ConvShape(x, w, len(node.inputs) > 2, tuple(op.strides), tuple(op.pad_begins), tuple(op.pad_ends),
                     tuple(op.dilations), np.dtype(t[node.inputs[0]].dtype).name, op.channels_last)


def plan_convs(graph, nodes, device_id: int = 0) -> tuple[dict[str, CudnnConv], dict[str, str]]:
    """Choose each Conv node's route once: ({node: its built cuDNN graph}, {node: why it runs
    on im2col + cuBLAS instead})."""
    nodes = list(nodes)
    cudnn, why = load() if nodes else (None, "")
    routes, fallbacks = {}, {}
    for node in nodes:
        shape = conv_shape(graph, node)
        reason = why or unsupported_reason(shape)
        if not reason:
            try:
                routes[node.name] = build(shape, device_id)
                continue
            except Exception as e:   # no engine for this shape (cudnnGraphNotSupportedError and kin)
                reason = f"no cuDNN engine ({type(e).__name__}: {str(e).strip()[:200]})"
        fallbacks[node.name] = f"Conv through im2col + cuBLAS: {reason}"
    return routes, fallbacks


_BIAS_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// y[n, m, s] += b[m] in fp32, rounded once (y is N x M x S, row-major)
template <typename T, typename F, typename B>
__device__ void bias_add(T* y, const T* b, long long total, long long S, int M, F to_f, B from_f) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step)
        y[i] = from_f(to_f(y[i]) + to_f(b[(i / S) % M]));
}
extern "C" __global__ void pf_bias_add_float32(float* y, const float* b, long long total, long long S, int M) {
    bias_add(y, b, total, S, M, [](float v) { return v; }, [](float v) { return v; });
}
extern "C" __global__ void pf_bias_add_float16(__half* y, const __half* b, long long total, long long S, int M) {
    bias_add(y, b, total, S, M, [](__half v) { return __half2float(v); }, [](float v) { return __float2half_rn(v); });
}
extern "C" __global__ void pf_bias_add_bfloat16(__nv_bfloat16* y, const __nv_bfloat16* b, long long total,
                                                 long long S, int M) {
    bias_add(y, b, total, S, M, [](__nv_bfloat16 v) { return __bfloat162float(v); },
             [](float v) { return __float2bfloat16_rn(v); });
}
"""


@functools.cache
def _bias_kernel(dtype: str, device: int):
    from powerfusion.backends.cuda.runtime import compile_source
    return compile_source(_BIAS_SOURCE, name="pf_bias_add", device=device).kernel(f"pf_bias_add_{dtype}")


def add_bias(out, bias, dtype: str, channels_last: bool = False) -> None:
    """out[n, m, ...] += bias[m] (out[n, ..., m] += bias[m] channels-last) in place, on the
    current stream (capturable: no allocation)."""
    from powerfusion.backends.cuda.runtime import device_info
    kernel = _bias_kernel(dtype, out.device.id)
    m = bias.size
    n = out.size // m if channels_last else out.shape[0]
    spatial = 1 if channels_last else out.size // max(n * m, 1)
    threads = 256
    blocks = max(1, min(-(-out.size // threads), device_info(out.device.id).sm_count * 32))
    kernel.launch((blocks,), (threads,), (out, bias, np.int64(out.size), np.int64(spatial), np.int32(m)))


__all__ = ["ConvShape", "CudnnConv", "WORKSPACE_LIMIT", "add_bias", "build", "conv_shape", "handle", "load",
           "plan_convs", "scratch", "time_us", "unsupported_reason"]
