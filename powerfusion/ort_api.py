"""onnxruntime's session vocabulary, so that a script written for onnxruntime runs with
`import powerfusion as ort` in place of `import onnxruntime as ort`.

What each setting means here (the rest of onnxruntime's settings are accepted and have no
effect, which `SessionOptions.__setattr__` does not hide: unknown names are refused):

- providers: `CUDAExecutionProvider` (options: `device_id`) -> target "cuda" on that device;
  `CPUExecutionProvider` -> target "cpu". The first provider we can run wins, as in
  onnxruntime; a list naming none of them is an error that lists the ones we know.
- `SessionOptions.log_severity_level`: 0 verbose -> verbose 2, 1 info -> 1, 2+ -> 0.
- `SessionOptions.graph_optimization_level`: the search effort. ORT_DISABLE_ALL compiles
  each memory-bound subgraph with its default plan (no search); the other levels search with
  the default time budget.
- `SessionOptions.intra_op_num_threads`: threads of the CPU target's BLAS during `run`
  (through threadpoolctl); 0 leaves the default.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

from powerfusion.errors import PowerFusionError

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
PROVIDER_TARGETS = {CUDA_PROVIDER: "cuda", CPU_PROVIDER: "cpu"}
TARGET_PROVIDERS = {v: k for k, v in PROVIDER_TARGETS.items()}


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's levels (same names and values)."""
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


# Settings onnxruntime scripts commonly set that change nothing here (no ONNX graph rewrites of
# onnxruntime's kind, no profiler of its kind); accepted so such scripts run unchanged.
_INERT = {"inter_op_num_threads": 0, "execution_mode": ExecutionMode.ORT_SEQUENTIAL, "enable_profiling": False,
          "enable_mem_pattern": True, "enable_cpu_mem_arena": True, "enable_mem_reuse": True,
          "optimized_model_filepath": "", "log_verbosity_level": 0, "logid": "", "profile_file_prefix": "",
          "use_deterministic_compute": False}


class SessionOptions:
    """The subset of onnxruntime.SessionOptions that means something here (see the module doc)."""

    def __init__(self):
        object.__setattr__(self, "_values", {"log_severity_level": 2,
                                             "graph_optimization_level": GraphOptimizationLevel.ORT_ENABLE_ALL,
                                             "intra_op_num_threads": 0, **_INERT})
        object.__setattr__(self, "_config", {})

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"SessionOptions has no setting {name!r}")

    def __setattr__(self, name, value):
        if name not in self._values:
            raise PowerFusionError(f"SessionOptions: unknown setting {name!r}; known: {sorted(self._values)}")
        if name == "graph_optimization_level":
            value = GraphOptimizationLevel(int(value))
        self._values[name] = value

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._config[key] = value

    def get_session_config_entry(self, key: str) -> str:
        return self._config[key]

    def verbose(self) -> int:
        level = int(self.log_severity_level)
        return 2 if level <= 0 else 1 if level == 1 else 0

    def search_budget_s(self) -> float | None:
        """graph_optimization_level -> the search's time budget: 0 (the default plan only) for
        ORT_DISABLE_ALL, None (the search's default budget) otherwise."""
        return 0.0 if self.graph_optimization_level == GraphOptimizationLevel.ORT_DISABLE_ALL else None


@dataclass
class RunOptions:
    """Accepted by `run` as onnxruntime's; `terminate` is honoured before the run starts."""
    log_severity_level: int = 2
    log_verbosity_level: int = 0
    logid: str = ""
    run_tag: str = ""
    terminate: bool = False
    _config: dict = field(default_factory=dict, repr=False)

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._config[key] = value


@dataclass(frozen=True)
class ModelMetadata:
    """What `get_modelmeta()` returns, with onnxruntime's field names."""
    producer_name: str
    graph_name: str
    graph_description: str
    domain: str
    description: str
    version: int
    custom_metadata_map: dict


@dataclass(frozen=True)
class ProviderChoice:
    target: str
    device_id: int
    provider: str


def get_available_providers() -> list[str]:
    """Providers this installation can run, best first (CUDA only with CuPy and a GPU)."""
    return [CUDA_PROVIDER, CPU_PROVIDER] if _cuda_device() else [CPU_PROVIDER]


def _cuda_device() -> bool:
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:   # CuPy without a driver raises at first use
        return False


def get_all_providers() -> list[str]:
    return [CUDA_PROVIDER, CPU_PROVIDER]


def get_device() -> str:
    return "GPU" if CUDA_PROVIDER in get_available_providers() else "CPU"


def choose_provider(providers, provider_options=None) -> ProviderChoice | None:
    """onnxruntime's `providers` (names or (name, options) pairs) -> the first one we support.
    None when `providers` is None (the caller's target= / options decide)."""
    if providers is None:
        return None
    entries = []
    for k, p in enumerate(providers):
        name, opts = (p, {}) if isinstance(p, str) else (p[0], dict(p[1] or {}))
        if provider_options is not None and k < len(provider_options):
            opts = {**opts, **dict(provider_options[k] or {})}
        entries.append((name, opts))
    unknown = [n for n, _ in entries if n not in PROVIDER_TARGETS and n not in _SKIPPABLE]
    if unknown:
        raise PowerFusionError(f"unknown execution provider(s) {unknown}; PowerFusion runs "
                               f"{list(PROVIDER_TARGETS)} (available here: {get_available_providers()})")
    for name, opts in entries:
        if name in PROVIDER_TARGETS:
            return ProviderChoice(PROVIDER_TARGETS[name], int(opts.get("device_id", 0)), name)
    raise PowerFusionError(f"none of the providers {[n for n, _ in entries]} can run here; "
                           f"PowerFusion runs {list(PROVIDER_TARGETS)}")


# onnxruntime providers a script may list first for onnxruntime's sake; we pass over them to the
# next one we run, as onnxruntime passes over providers it was not built with.
_SKIPPABLE = {"TensorrtExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider",
              "OpenVINOExecutionProvider", "DmlExecutionProvider", "CoreMLExecutionProvider",
              "AzureExecutionProvider"}


def model_metadata(proto) -> ModelMetadata:
    if proto is None:
        return ModelMetadata("", "", "", "", "", 0, {})
    return ModelMetadata(proto.producer_name, proto.graph.name, proto.graph.doc_string, proto.domain,
                         proto.doc_string, int(proto.model_version),
                         {p.key: p.value for p in proto.metadata_props})


def intra_op_threads(n: int):
    """A context that limits the BLAS threads of a CPU run to `n` (threadpoolctl); n <= 0: no limit."""
    if n <= 0:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=int(n), user_api="blas")
