"""CUDA runtime: compile emitted source with NVRTC (through CuPy), cache the cubin on
disk, load it and launch kernels. CuPy is imported inside functions only, so this module
imports (and `compile_check_nvcc` works) on machines without a GPU.

Kernels are looked up by their unmangled name, so emitted kernels are `extern "C"`.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from powerfusion.errors import CompileError
from powerfusion.runtime.cache import KernelCache, source_hash

# Options every compile gets; no --use_fast_math by default, so results match numpy within
# the stated tolerances (callers may add it per kernel).
BASE_OPTIONS = ("-std=c++17",)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    name: str
    arch: str              # "sm_90"
    compute_capability: int  # 90
    sm_count: int
    l2_bytes: int
    memory_bytes: int


def device_info(index: int | None = None) -> DeviceInfo:
    """Facts about a device (default: CuPy's current one)."""
    import cupy
    return _device_info(cupy.cuda.Device().id if index is None else index)


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> DeviceInfo:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    cc = props["major"] * 10 + props["minor"]
    return DeviceInfo(index, name, f"sm_{cc}", cc, int(props["multiProcessorCount"]),
                      int(props["l2CacheSize"]), int(props["totalGlobalMem"]))


def nvrtc_version() -> tuple[int, int]:
    import cupy
    return tuple(cupy.cuda.nvrtc.getVersion())


@functools.lru_cache(maxsize=1)
def _include_options() -> tuple[str, ...]:
    """-I for the CUDA headers (cuda_fp16.h, cuda_bf16.h) where CuPy knows the toolkit."""
    try:
        from cupy import _environment
        cuda_path = _environment.get_cuda_path()
    except Exception:  # CuPy internals moved: NVRTC's built-in headers may still suffice
        return ()
    include = Path(cuda_path) / "include" if cuda_path else None
    return (f"-I{include}",) if include is not None and include.is_dir() else ()


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel of a loaded module; `launch` enqueues it on a CuPy stream."""
    name: str
    function: object       # cupy.cuda.function.Function
    binary_kind: str       # "cubin" | "ptx"

    def launch(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
        block = tuple(block) if isinstance(block, (tuple, list)) else (int(block),)
        if stream is None:  # cupy.cuda.Function launches on the null stream unless told: use the current one
            import cupy
            stream = cupy.cuda.get_current_stream()
        self.function(grid, block, tuple(args), shared_mem=shared_mem, stream=stream)


class CudaModule:
    """A compiled and loaded translation unit; `kernel(name)` gives a launchable kernel."""

    def __init__(self, module, binary_kind: str, cache_hit: bool):
        self._module = module
        self.binary_kind = binary_kind
        self.cache_hit = cache_hit

    def kernel(self, name: str) -> CompiledKernel:
        return CompiledKernel(name, self._module.get_function(name), self.binary_kind)

    def word(self, name: str):
        """A module's `__device__ unsigned int <name>` as a one-element CuPy uint32 array (a view
        of the variable: reading it copies it down, filling it writes it)."""
        import cupy
        import numpy as np
        ptr = self._module.get_global_var(name)
        memory = cupy.cuda.UnownedMemory(ptr, 4, self, cupy.cuda.Device().id)   # the module's device: current at load
        return cupy.ndarray((1,), np.uint32, cupy.cuda.MemoryPointer(memory, 0))


def compile_source(source: str, options: tuple[str, ...] = (), *, name: str = "pf_kernels",
                   cache: KernelCache | None = None, device: int | None = None) -> CudaModule:
    """Compile CUDA source for the current device with NVRTC (disk-cached) and load it."""
    from cupy.cuda import function

    cache = cache if cache is not None else _default_cache()
    key, build, kind = _nvrtc_job(source, options, name, device)
    hits_before = cache.stats.hits
    binary = cache.get_or_build(key, build)
    module = function.Module()
    module.load(binary)  # cuModuleLoadData takes cubin or PTX (which the driver JIT-compiles)
    return CudaModule(module, kind, cache.stats.hits > hits_before)


def precompile_sources(items, *, jobs: int | None = None, cache: KernelCache | None = None,
                       device: int | None = None) -> int:
    """Compile `(source, options, name)` items into the kernel cache at once, on `jobs` threads
    (default: the usable cores), so that `compile_source` then finds each binary cached; returns
    how many were compiled (see KernelPrefetch)."""
    prefetch = KernelPrefetch(jobs=jobs, cache=cache, device=device)
    prefetch.submit(items)
    return prefetch.wait()


class KernelPrefetch:
    """NVRTC compiles into the kernel cache on background threads: `submit` hands kernels over
    and returns at once, `wait` joins them. NVRTC compiles one program per call and holds no
    Python lock meanwhile (CuPy calls it `nogil`), so a model's ~100 kernels take about 1 / jobs
    of the time one after another, and while the pipeline renders the next subgraph's kernels.
    Kernels already cached or already handed over are skipped. A failure surfaces in the later
    `compile_source` of the same kernel (with its message), not here."""

    def __init__(self, *, jobs: int | None = None, cache: KernelCache | None = None, device: int | None = None):
        if jobs is None:
            from powerfusion.options import usable_cores
            jobs = usable_cores()
        self.jobs = max(1, jobs)
        self.cache = cache if cache is not None else _default_cache()
        self.device = device
        self._seen: set[str] = set()
        self._futures: list = []
        self._pool = None

    def submit(self, items) -> None:
        from concurrent.futures import ThreadPoolExecutor
        try:
            import cupy  # noqa: F401
        except ImportError:   # nothing to compile with: loading the kernels will say so
            return
        for source, options, name in items:
            key, build, _ = _nvrtc_job(source, tuple(options), name, self.device)
            ident = json.dumps(key, sort_keys=True)
            if ident in self._seen:
                continue
            self._seen.add(ident)
            if self.cache.lookup(key) is not None:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="pf-nvrtc")
            self._futures.append(self._pool.submit(self._build, key, build))

    def _build(self, key, build) -> bool:
        try:
            self.cache.get_or_build(key, build)
        except CompileError:
            return False   # raised again, with the same message, where the kernel is loaded
        return True

    def wait(self) -> int:
        """Join every compile handed over so far; how many built a binary."""
        built = 0
        for future in self._futures:
            try:
                built += bool(future.result())
            except Exception:  # noqa: BLE001 - whatever it was, loading the kernel raises it again
                pass
        self._futures = []
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return built


def _nvrtc_job(source: str, options: tuple[str, ...], name: str, device: int | None):
    """(cache key, build function, binary kind) of one NVRTC compile for the device."""
    import cupy
    from cupy.cuda import compiler

    info = device_info(device)
    all_options = tuple(BASE_OPTIONS) + tuple(options)
    arch_option, kind = _nvrtc_target(info.compute_capability)
    key = {"source": source_hash(source), "arch": info.arch, "target": arch_option,
           "compiler": "nvrtc-%d.%d" % nvrtc_version(), "options": list(all_options),
           "cupy": cupy.__version__}

    def build() -> bytes:
        try:
            binary, _ = compiler.compile_using_nvrtc(
                source, all_options + _include_options(), arch=str(info.compute_capability),
                filename=f"{name}.cu", cache_in_memory=True)
        except compiler.CompileException as e:
            raise CompileError(_compile_failure(source, name, e.get_message())) from None
        return binary.encode() if isinstance(binary, str) else bytes(binary)

    return key, build, kind


def _nvrtc_target(cc: int) -> tuple[str, str]:
    """CuPy's choice: -arch=sm_XX (cubin) when NVRTC knows the device, else compute_XX (PTX)."""
    from cupy.cuda import compiler
    try:
        return compiler._get_arch_for_options_for_nvrtc(str(cc))
    except AttributeError:  # CuPy internals moved; NVRTC 11.1+ emits cubin for sm_XX
        return f"-arch=sm_{cc}", "cubin"


@functools.lru_cache(maxsize=1)
def _default_cache() -> KernelCache:
    return KernelCache()


def _compile_failure(source: str, name: str, log: str) -> str:
    """Keep the failing source on disk so the message can point at it."""
    folder = Path(tempfile.mkdtemp(prefix="powerfusion-failed-"))
    path = folder / f"{name}.cu"
    path.write_text(source)
    return f"NVRTC rejected generated source {path}:\n{log.strip()}"


def compile_check_nvcc(source: str | os.PathLike, arch: str = "sm_80",
                       options: tuple[str, ...] = ()) -> None:
    """Compile a .cu file (or source text) to cubin with nvcc; raise CompileError on failure.

    For tests of emitted code on machines without a GPU. `source` is a path to an existing
    file or the source text itself.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on PATH")
    with tempfile.TemporaryDirectory(prefix="powerfusion-nvcc-") as tmp:
        path = Path(source) if _is_existing_file(source) else Path(tmp) / "kernel.cu"
        if path.parent == Path(tmp):
            path.write_text(str(source))
        out = Path(tmp) / "kernel.cubin"
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", *options, "-o", str(out), str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            if path.parent == Path(tmp):  # keep the text for the message
                kept = Path(tempfile.mkdtemp(prefix="powerfusion-failed-")) / "kernel.cu"
                kept.write_text(str(source))
                path = kept
            raise CompileError(f"nvcc ({arch}) rejected {path}:\n{(proc.stderr + proc.stdout).strip()}")


def _is_existing_file(source) -> bool:
    if isinstance(source, os.PathLike):
        return True
    return "\n" not in source and len(source) < 4096 and Path(source).is_file()
