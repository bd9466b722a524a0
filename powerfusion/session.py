"""`InferenceSession`: run an ONNX model through PowerFusion, with onnxruntime's API.

    sess = InferenceSession("model.onnx")            # target "cpu" by default
    [y] = sess.run(None, {"x": x})

The model goes through the compile pipeline once, at construction (pipeline/driver.py). On the
CPU target every memory-bound subgraph is lowered to GIR, rewritten and compiled to C then
(backends/cpu/), and the partition runs step by step: library calls (MatMul, Conv) through numpy
(TypedMatMul through ttile's MatMulNBits reference / an ONNX DequantizeLinear),
memory-bound subgraphs through their generated C (target "cpu") or their rewritten GIR graph
on the fast GIR executor (target "cpu-reference", gir/fastexec.py) -- or, where a subgraph could not be lowered, through the basic-op
executor, with a `BasicFallbackWarning` and the reason in `session.fallbacks`.
`session.subgraph_paths` says which path each subgraph takes. Other targets plug in an
executor built by their backend.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from powerfusion import options as _options
from powerfusion.targets import registry
from powerfusion.errors import FeedError, PowerFusionError
from powerfusion.basic import (BasicGraph, Conv, LibraryCall, MatMul, OnnxFallback, Partition, Subgraph,
                               TensorInfo, TypedMatMul, Attention)
from powerfusion.backends.cpu.session import (CPU_SESSION_TARGET, BasicFallbackWarning,  # noqa: F401
                                              CpuPlan, compile_cpu_plan, failure)
from powerfusion.pipeline.driver import CompileOptions, Observer, compile

# An executor maps feeds (validated, by graph input name) to a dict holding at least
# every graph output; the CPU one returns every tensor it computed.
Executor = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

# onnxruntime constructor keywords that change nothing here (no onnxruntime graph optimisers)
_IGNORED_ORT_KWARGS = {"disabled_optimizers", "read_config_from_model"}


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
    """Import, partition and prepare a model for a target, with onnxruntime's constructor.

    `path_or_bytes`: an .onnx path, its bytes, an onnx.ModelProto, or a folder that
    `powerfusion compile -o DIR` wrote (loaded without searching again; see artefact.py).
    `sess_options`, `providers`, `provider_options`: onnxruntime's (powerfusion.ort_api says
    what each setting means here). Beyond onnxruntime: `target` ("cpu", "cuda", a device name),
    `shapes` fixes dynamic input dimensions ({"x": (1, 3, 224, 224)} or "x:1x3x224x224"), and
    `options` is a dict of settings for this session (see powerfusion.options).
    """

    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, *,
                 target: str | None = None, shapes=None, options: Mapping | None = None, **kwargs):
        from powerfusion import ort_api
        if isinstance(sess_options, str):
            raise PowerFusionError(f"the second argument is onnxruntime's sess_options; name the target: "
                                   f"InferenceSession(model, target={sess_options!r})")
        unknown = sorted(set(kwargs) - _IGNORED_ORT_KWARGS)
        if unknown:
            raise PowerFusionError(f"InferenceSession: unknown keyword argument(s) {unknown}")
        changes = dict(options or {})
        if sess_options is not None:
            changes.setdefault("verbose", sess_options.verbose())
            changes.setdefault("search_budget_s", sess_options.search_budget_s())
            changes.setdefault("intra_op_threads", int(sess_options.intra_op_num_threads))
        choice = ort_api.choose_provider(providers, provider_options)
        if choice is not None:
            if target is not None and get_target_backend(target) != choice.target:
                raise PowerFusionError(f"target={target!r} and providers={providers!r} disagree; give one of them")
            target = target or choice.target
            changes.setdefault("device_id", choice.device_id)
        self.sess_options = sess_options
        with _options.context(**changes) as opts:
            self.options = opts
            self._build(path_or_bytes, target or opts.target, shapes)
        self._lock = threading.Lock()   # one run at a time per session: runs share one arena
        self._feed_spec = None          # (array type, {input: (dtype, shape)}), made at the first run

    def _build(self, model, target: str, shapes) -> None:
        from powerfusion.targets.specs import get_target

        self.target = target
        entry = registry.backend(get_target(self.target).backend)  # unknown names raise a PowerFusionError
        if entry.runtime is None:
            raise PowerFusionError(
                f"target '{self.target}' ({entry.name}) can be compiled (`powerfusion compile`) but not run "
                f"from Python here; runnable backends: {', '.join(registry.runnable_backends())}")
        backend = entry.name
        self._profile: list = []   # the last CPU run's (step name, seconds) and runs of steps in C
        self.cpu_plan: CpuPlan | None = None
        self.artefact = None
        if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
            self._build_from_artefact(model, backend)
            return
        self._model = model
        if isinstance(shapes, str):
            from powerfusion.frontend.loader import parse_shapes
            shapes = parse_shapes(shapes)
        say = _progress(self.options)
        steps = _BuildSteps(say, backend)
        if backend != "cpu":
            make_executor = _runtime(entry)
            detail = say if self.options.verbose >= 2 else None   # -vv: each subgraph as the search reaches it
            prefetch = _KernelPrefetch(self.options) if backend == "cuda" else None
            try:
                plan = compile(model, self.target, CompileOptions(shapes=shapes, fallback=self.options.fallback,
                                                                  precision=self.options.precision, progress=detail),
                               (steps,) + ((prefetch,) if prefetch else ()))
            finally:
                if prefetch is not None:
                    prefetch.pool.wait()
            steps.done(f"compile for {backend}")
            if detail:
                detail("search and codegen: " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items()))
            self._executor: Executor = make_executor(plan, self.options)
            _warn_library_fallbacks(getattr(self._executor, "fallbacks", {}), len(plan.library_steps))
        else:
            _note_fp32_matmul_ignored(self.options)
            # every subgraph's default plan, rewritten, for the CPU session's spec; a subgraph the
            # pipeline cannot compile runs on the basic-op executor (named, warned)
            failed = _Failures()
            plan = compile(model, self.target, CompileOptions(shapes=shapes, fallback=self.options.fallback,
                                                              precision=self.options.precision,
                                                              choose="default", render=False,
                                                              plan_target=CPU_SESSION_TARGET, keep_going=True,
                                                              zero_size="keep"),
                           (steps, failed))
            # "cpu" runs generated C; "cpu-reference" the numpy reference (the fast GIR executor)
            self.cpu_plan = compile_cpu_plan(plan, failed.reasons, native=self.target.lower() != "cpu-reference")
            steps.done("lower to GIR for cpu")
            self._executor = self._run_cpu
        self.graph: BasicGraph = plan.graph
        self.partition: Partition = plan.partition

    def _build_from_artefact(self, folder, backend: str) -> None:
        from powerfusion.artefact import load_artefact
        if backend != "cuda":
            raise PowerFusionError(f"'{folder}' is a compiled folder (CUDA kernels); it runs on target 'cuda', "
                                   f"not '{self.target}'. Give the .onnx file to run on the CPU.")
        self.artefact = load_artefact(folder)
        self._model = self.artefact.model_path
        self.graph = self.artefact.graph
        self.partition = None
        self._executor = self.artefact.make_executor(self.options)

    def _run_cpu(self, feeds, every_tensor: bool = False):
        from powerfusion.ort_api import intra_op_threads
        plan = self.cpu_plan
        if every_tensor and plan is not None and plan.pieces is not None:
            # step by step: a convolution of the driver that applies the activation after it
            # (backends/cpu/epilogue.py) never makes its own output
            plan = dataclasses.replace(plan, pieces=None)
        with intra_op_threads(self.options.intra_op_threads):
            return execute_partition(self.partition, feeds, self._profile, plan)

    @property
    def profile(self) -> list[tuple[str, float]]:
        """(step name, seconds) of each step of the last CPU run, in order."""
        return [item for piece in self._profile
                for item in ([piece] if isinstance(piece, tuple) else piece.step_times())]

    # ---- onnxruntime API --------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(t) for t in self.graph.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(t) for t in self.graph.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        return []   # initializers are folded into the compiled plan

    def get_providers(self) -> list[str]:
        from powerfusion.ort_api import TARGET_PROVIDERS
        return [TARGET_PROVIDERS[get_target_backend(self.target)]]

    def get_provider_options(self) -> dict:
        provider = self.get_providers()[0]
        return {provider: {"device_id": str(self.options.device_id)} if provider.startswith("CUDA") else {}}

    def get_session_options(self):
        from powerfusion.ort_api import SessionOptions
        return self.sess_options if self.sess_options is not None else SessionOptions()

    def get_modelmeta(self):
        from powerfusion.ort_api import model_metadata
        return model_metadata(None if self._model is None else _model_header(self._model))

    def set_providers(self, providers=None, provider_options=None) -> None:
        raise PowerFusionError("set_providers: a session is compiled for one target; make a new InferenceSession")

    def run(self, output_names, input_feed: Mapping, run_options=None) -> list:
        """Outputs named by `output_names` (None or []: all, in the model's order), as numpy
        arrays; on the cuda target device inputs (CuPy, torch, DLPack) are read in place."""
        names = self._output_names(output_names)
        if run_options is not None and getattr(run_options, "terminate", False):
            raise PowerFusionError("run: run_options.terminate is set")
        feeds = self.validate_feeds(input_feed)
        with self._lock:
            env = self._executor(feeds)
        return [_own_array(env[n], self.graph.constants, feeds) for n in names]

    def io_binding(self):
        """onnxruntime's IOBinding: bind inputs and outputs to (device) buffers, then
        `run_with_iobinding`."""
        from powerfusion.iobinding import IOBinding
        return IOBinding(self)

    def run_with_iobinding(self, iobinding, run_options=None) -> None:
        """Run with the binding's inputs and outputs. As in onnxruntime, the call returns when
        every output is complete (on the cuda target: the caller's current CuPy stream, on
        which the run is queued, is synchronised), so the outputs may be read at once."""
        if run_options is not None and getattr(run_options, "terminate", False):
            raise PowerFusionError("run_with_iobinding: run_options.terminate is set")
        iobinding.run()

    def run_bound(self, input_feed: Mapping, wanted: Mapping[str, tuple]) -> dict:
        """The run behind IOBinding: `wanted` maps output name -> (device "cpu" | "cuda", buffer or
        None); returns each wanted output on its device (in its buffer where one was given)."""
        return self.prepare_bound(input_feed, wanted)()

    def prepare_bound(self, input_feed: Mapping, wanted: Mapping[str, tuple]) -> Callable[[], dict]:
        """`run_bound(input_feed, wanted)` as a callable to repeat: names, shapes and dtypes are
        checked once, here, and an executor that can prepares its part once too (the cuda
        target's bound.py). Each call reads the bound arrays again (their contents may change;
        the arrays themselves may not) and runs under the session's lock."""
        names = self._output_names(list(wanted))
        feeds = self.validate_feeds(input_feed)
        wanted = dict(wanted)
        prepare = getattr(self._executor, "prepare_bound", None)
        if prepare is not None and all(device == "cuda" for device, _ in wanted.values()):
            run = prepare(feeds, names, {n: buf for n, (_, buf) in wanted.items() if buf is not None})
            lock = self._lock

            def on_device() -> dict:   # the outputs come back in their buffers or as fresh CuPy arrays
                with lock:
                    return run()
            return on_device
        return lambda: self._run_bound(feeds, names, wanted)

    def _run_bound(self, feeds: dict, names: list[str], wanted: dict) -> dict:
        with self._lock:
            if hasattr(self._executor, "run_device"):   # the cuda target: outputs stay on the GPU
                into = {n: buf for n, (device, buf) in wanted.items() if device == "cuda" and buf is not None}
                env = self._executor.run_device(feeds, names, into)
            else:
                env = self._executor(feeds)
        return {n: _place(env[n], *wanted[n], self.graph.tensors[n].dtype) for n in names}

    def _output_names(self, output_names) -> list[str]:
        names = [t.name for t in self.graph.outputs] if not output_names else list(output_names)
        known = {t.name for t in self.graph.outputs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise PowerFusionError(f"unknown output name(s) {unknown}; the model's outputs are {sorted(known)}")
        return names

    # ---- beyond onnxruntime -----------------------------------------------------

    @property
    def subgraph_paths(self) -> dict[str, str]:
        """Subgraph name -> "gir" (rewritten GIR on the fast executor) or "basic" (fallback)."""
        return {} if self.cpu_plan is None else self.cpu_plan.paths

    @property
    def fallbacks(self) -> dict[str, str]:
        """Step name -> why it runs on a fallback path: a subgraph on the basic-op executor (cpu
        targets), a Conv on im2col + cuBLAS instead of cuDNN (cuda); empty when none does."""
        plan = {} if self.cpu_plan is None else self.cpu_plan.fallbacks
        return {**plan, **getattr(self._executor, "fallbacks", {})}

    def run_all_tensors(self, input_feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the run computes, by name (for per-subgraph comparison)."""
        feeds = self.validate_feeds(input_feed)
        with self._lock:
            if hasattr(self._executor, "all_tensors"):   # cuda: every step's outputs, copied to the host
                return self._executor.all_tensors(feeds)
            return self._run_cpu(feeds, every_tensor=True)

    def validate_feeds(self, input_feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check names, shapes and dtypes of the feeds; a FeedError names the input and both sides."""
        if not isinstance(input_feed, Mapping):
            raise FeedError(f"input_feed must be a dict of input name -> array, given {type(input_feed).__name__}; "
                            f"expected inputs: " + ", ".join(_describe(t) for t in self.graph.inputs))
        fast = self._feeds_as_given(input_feed)
        if fast is not None:
            return fast
        expected = {t.name: t for t in self.graph.inputs}
        unknown = sorted(set(input_feed) - set(expected))
        missing = [n for n in expected if n not in input_feed]
        if unknown or missing:
            raise FeedError(f"feeds do not match the model's inputs: unknown {unknown}, missing {missing}; "
                            f"expected inputs: " + ", ".join(_describe(t) for t in self.graph.inputs))
        on_device = get_target_backend(self.target) == "cuda"
        return {name: _feed_array(name, info, input_feed[name], on_device) for name, info in expected.items()}

    def _feeds_as_given(self, input_feed: Mapping) -> dict | None:
        """The feeds unchanged when every one already is what `_feed_array` would return (the
        array type the target reads, the input's exact dtype and shape, nothing extra); None
        sends the feeds through the full check. Saves the per-call checks of IO binding."""
        spec = self._feed_spec
        if spec is None:
            on_device = get_target_backend(self.target) == "cuda"
            kind = np.ndarray
            if on_device:
                try:
                    import cupy
                    kind = cupy.ndarray
                except ImportError:
                    kind = None
            def dtype(t):   # CuPy has no bfloat16: on the GPU its bits travel as uint16
                d = np.dtype(t.dtype)
                return np.dtype(np.uint16) if on_device and d.name == "bfloat16" else d
            spec = self._feed_spec = (kind, {t.name: (dtype(t), tuple(int(d) for d in t.shape))
                                             for t in self.graph.inputs})
        kind, inputs = spec
        if kind is None or len(input_feed) != len(inputs):
            return None
        for name, (dtype, shape) in inputs.items():
            value = input_feed.get(name)
            if type(value) is not kind or value.dtype != dtype or value.shape != shape:
                return None
        return dict(input_feed)


def _feed_array(name: str, info: TensorInfo, value, on_device: bool):
    """One feed as an array of the input's dtype: lists and scalars converted as onnxruntime
    converts them (to the input's dtype); GPU arrays kept on the GPU for the cuda target."""
    from powerfusion.device_arrays import as_cupy, is_device_array, to_host
    want = np.dtype(info.dtype)
    if is_device_array(value):
        given = as_cupy(value, f"input '{name}'") if on_device else to_host(value, f"input '{name}'")
        if want.name == "bfloat16" and given.dtype == np.uint16:
            want = given.dtype   # CuPy has no bfloat16: its bits travel as uint16
    elif isinstance(value, (list, tuple, int, float, bool)):
        given = np.asarray(value, dtype=want)
    else:
        given = np.asarray(value)
    if given.dtype != want or tuple(given.shape) != tuple(info.shape):
        raise FeedError(f"input '{name}': expected shape {tuple(info.shape)} dtype {want.name}, "
                        f"given shape {tuple(given.shape)} dtype {given.dtype.name}")
    return given


def _own_array(value, constants: dict, feeds: dict):
    """An output the caller may change freely: a copy where it shares memory with one of the
    session's constants (changing it would corrupt later runs) or with a host feed. Device
    arrays (cuda target) are the session's fresh outputs and pass through."""
    if not isinstance(value, np.ndarray):
        return value
    if value.base is None and not any(value is c for c in (*constants.values(), *feeds.values())):
        return value   # an array of its own, made by the run (may_share_memory on each constant: ~0.5 us each)
    if any(isinstance(c, np.ndarray) and np.may_share_memory(value, c)
           for c in (*constants.values(), *feeds.values())):
        return value.copy()
    return value


def get_target_backend(target: str) -> str:
    from powerfusion.targets.specs import get_target
    return get_target(target).backend


def _place(value, device: str, buffer, dtype):
    """An output moved to `device` (into `buffer` when given); bf16 on a GPU as uint16 bits."""
    from powerfusion.device_arrays import is_device_array
    if device == "cpu":
        host = value.get() if is_device_array(value) else value
        if np.dtype(dtype).name == "bfloat16" and host.dtype == np.uint16:
            host = host.view(np.dtype(dtype))
        if buffer is None:
            return host
        np.copyto(buffer, host.reshape(buffer.shape))
        return buffer
    import cupy
    if not is_device_array(value):
        value = cupy.asarray(value.view(np.uint16) if value.dtype.name == "bfloat16" else value)
    if buffer is None or buffer is value:
        return value
    buffer[...] = value.reshape(buffer.shape)
    return buffer


def _model_header(model):
    """The ModelProto's metadata fields without its weights (for get_modelmeta); the frontend
    has already checked the model."""
    import onnx
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model), load_external_data=False)
    return model


def _progress(opts):
    """A printer of build steps on stderr at verbose >= 1 (a no-op otherwise)."""
    import sys
    if opts.verbose < 1:
        return lambda message: None
    return lambda message: print(f"[powerfusion] {message}", file=sys.stderr, flush=True)


def _node_arg(t: TensorInfo) -> NodeArg:
    return NodeArg(t.name, [int(d) for d in t.shape], onnx_type_string(t.dtype))


def _describe(t: TensorInfo) -> str:
    return f"'{t.name}' {tuple(t.shape)} {np.dtype(t.dtype).name}"


def _runtime(entry):
    """A backend's registered runtime, `make_executor(plan, options) -> Executor`, checked to
    run here before the model is compiled; its dependencies (a GPU library such as CuPy) are
    optional installs."""
    try:
        make_executor = entry.load_runtime()
        entry.check_runtime()
    except ImportError as e:
        raise PowerFusionError(
            f"the {entry.name} target is not available here ({e}). It needs {entry.requires}; "
            "use target='cpu' otherwise.") from None
    return make_executor


class _KernelPrefetch(Observer):
    """CUDA: each subgraph's kernels go to NVRTC on background threads as soon as they are
    rendered, so that compiling them overlaps rendering the next subgraphs; the plan runner then
    finds them in the kernel cache."""

    def __init__(self, options):
        from powerfusion.backends.cuda.runtime import KernelPrefetch
        self.pool = KernelPrefetch(device=int(getattr(options, "device_id", 0)))

    def rendered(self, sub, kernels) -> None:
        self.pool.submit((k.source, (), k.name) for k in kernels)


class _BuildSteps(Observer):
    """The build steps' seconds as each ends (at verbose >= 1), and a progress bar over the
    subgraphs as the pipeline lowers them for the CPU."""

    def __init__(self, say, backend: str):
        self.say, self.backend, self.start, self.bar = say, backend, time.perf_counter(), None

    def _seconds(self) -> float:
        """Seconds since the previous step ended (or the build began)."""
        now = time.perf_counter()
        seconds, self.start = now - self.start, now
        return seconds

    def imported(self, graph) -> None:
        self.say(f"import: {self._seconds():.2f} s")

    def partitioned(self, partition) -> None:
        self.say(f"partition: {self._seconds():.2f} s")
        self.say(f"{len(partition.library_calls)} library call(s), {len(partition.subgraphs)} memory-bound subgraph(s)")
        if self.backend == "cpu":   # (the CUDA search shows its own bar per subgraph)
            from powerfusion.progress import progress_bar
            self.bar = progress_bar(total=len(partition.subgraphs), desc="lowering to GIR", unit="subgraph")

    def chosen(self, sub, choice) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def failed(self, sub, stage, error) -> None:
        self.chosen(sub, None)

    def done(self, step: str) -> None:
        if self.bar is not None:
            self.bar.close()
        self.say(f"{step}: {self._seconds():.2f} s")


class _Failures(Observer):
    """Why the pipeline could not compile a subgraph, by subgraph name."""

    def __init__(self):
        self.reasons: dict[str, str] = {}

    def failed(self, sub, stage, error) -> None:
        self.reasons[sub.name] = failure(error)


class Fp32MatmulIgnoredNote(UserWarning):
    """`fp32_matmul` was set for a target that always computes fp32 GEMMs exactly (CPU)."""


_FP32_MATMUL_NOTED: list[bool] = []


def _note_fp32_matmul_ignored(opts) -> None:
    """The CPU target accepts `fp32_matmul` (it may come from process-wide options meant for
    CUDA sessions) and ignores it: its GEMMs are numpy's. Said once per process."""
    if opts.fp32_matmul != "fp32" and not _FP32_MATMUL_NOTED:
        _FP32_MATMUL_NOTED.append(True)
        import warnings
        warnings.warn(f"fp32_matmul={opts.fp32_matmul!r} applies to the CUDA target only; the CPU target "
                      "computes fp32 MatMul / Gemm / Conv exactly and ignores it", Fp32MatmulIgnoredNote, stacklevel=3)


class LibraryFallbackWarning(UserWarning):
    """Library calls of a GPU session run off their fast route (cuDNN missing or declining, an
    attention on the uncaptured cuBLAS + CuPy stand-in, ...); `session.fallbacks` has each."""


def fallback_summary(fallbacks: Mapping[str, str], total: int, most: int = 3) -> str:
    """One line for the library calls that fell back: how many, and the commonest reasons with
    their counts (identical reasons collapse: twelve layers' attention give one entry)."""
    counts: dict[str, int] = {}
    for why in fallbacks.values():
        counts[why] = counts.get(why, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{n} x {why}" for why, n in ranked[:most]]
    more = f"; {len(ranked) - most} more reasons" if len(ranked) > most else ""
    return (f"{len(fallbacks)} of {total} library calls run off their fast route (session.fallbacks names "
            f"each): " + "; ".join(parts) + more)


def _warn_library_fallbacks(fallbacks: Mapping[str, str], total: int) -> None:
    """Said at build: a fallback can cost several times the call (BERT-base fp16 batch 8 with its
    attention on the stand-in: 7.5 ms against 0.74 ms, benchmarks/results/HISTORY.md)."""
    if fallbacks:
        import warnings
        warnings.warn(fallback_summary(fallbacks, max(total, len(fallbacks))), LibraryFallbackWarning, stacklevel=3)


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
    with plan.running() if plan is not None else contextlib.nullcontext():
        _execute_steps(partition, env, profile, plan)
    return env


def _execute_steps(partition: Partition, env: dict, profile: list | None, plan: "CpuPlan | None") -> None:
    pieces = plan.pieces if plan is not None and plan.pieces is not None else partition.steps
    for piece in pieces:
        if isinstance(piece, (Subgraph, LibraryCall)):
            start = time.perf_counter()
            _execute_step(piece, env, partition.graph, plan)
            if profile is not None:
                profile.append((piece.name if isinstance(piece, Subgraph) else piece.node.name,
                                time.perf_counter() - start))
        else:   # a run of steps in generated C (backends/cpu/driver.py); its times are read lazily
            piece.run(env)
            if profile is not None:
                profile.append(piece)


def _execute_step(step, env: dict, graph: BasicGraph, plan: "CpuPlan | None") -> None:
    from powerfusion.frontend.index_check import check_gathers, gather_nodes
    fused = step.nodes if isinstance(step, Subgraph) else ()
    check_gathers(gather_nodes(fused or [step.node]), env, graph.tensors, fused)
    if isinstance(step, LibraryCall):
        node = step.node
        out = graph.tensors[node.outputs[0]]
        inputs = [env[i] for i in node.inputs]
        got = plan.run_library(node, inputs) if plan is not None else None
        env[out.name] = got if got is not None else run_library_op(node.op, inputs, out.dtype)
    elif plan is not None and plan.runs(step, graph):
        plan.run(step, env, graph)
    else:
        execute_subgraph(step, env, graph)


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
    if dtype.kind in "iu":   # integer GEMMs (int8 x int8 -> int32) accumulate exactly
        return np.dtype(np.int64)
    if dtype.kind == "f" and dtype.itemsize < 4 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def run_library_op(op, inputs: list[np.ndarray], out_dtype) -> np.ndarray:
    if isinstance(op, TypedMatMul):  # low-bit constants: not cast to the compute dtype
        from powerfusion.frontend.quantized import run_typed_matmul
        return run_typed_matmul(op, inputs, out_dtype)
    if isinstance(op, OnnxFallback):  # the node as it is, in onnxruntime
        from powerfusion.frontend.fallback import run_fallback
        return run_fallback(op, inputs, out_dtype)
    if isinstance(op, Attention):   # float32 inside, rounded as the op says (numpy_exec)
        from powerfusion.frontend.numpy_exec import run_attention
        return run_attention(op, inputs, np.dtype(out_dtype))
    work = _compute_dtype(inputs[0].dtype)
    args = [np.asarray(x).astype(work, copy=False) for x in inputs]
    if isinstance(op, MatMul):
        a, b = args[:2]
        if op.trans_a:
            a = np.swapaxes(a, -1, -2)
        if op.trans_b:
            b = np.swapaxes(b, -1, -2)
        y = np.matmul(a, b)
        if op.bias:   # the epilogue: added before the one rounding
            y = y + args[2]
    elif isinstance(op, Conv):
        y = conv_nd(args[0], args[1], args[2] if len(args) > 2 else None, op)
    else:
        raise PowerFusionError(f"no CPU implementation for library op {type(op).__name__}")
    return np.asarray(y).astype(out_dtype, copy=False)


def conv_nd(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, op: Conv) -> np.ndarray:
    """ONNX Conv (1-3 spatial dims, grouped, strided, dilated) as im2col + one batched matmul."""
    if op.channels_last:   # NHWC operands (frontend/layout.py): the same conv on NCHW views
        y = conv_nd(np.moveaxis(x, -1, 1), np.moveaxis(w, -1, 1), b, dataclasses.replace(op, channels_last=False))
        return np.asarray(np.moveaxis(y, 1, -1), order="C")
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
