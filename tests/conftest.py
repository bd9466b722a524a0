"""Markers: `gpu` tests skip without CuPy and a CUDA device; `browser` tests skip without a
headless Chromium; `slow` tests run unless `-m "not slow"` deselects them.

Every test run compiles into its own cache folder (plans, kernels, compile results), never
the user's: `isolated_cache_dir` below. Tests that need a compiler call `require_tool` (or ask
for the `nvcc` / `gxx` fixture): a missing compiler skips, and fails where CI requires it.
`compiled(model, target)` is a bundled model (models/small/) compiled once per run.

Layout: `tests/unit/<package>/` is the fast lane -- unit tests that need no model compile,
compiler, device or long search, seconds per file (`pytest tests/unit`); the other folders
hold the model-level, toolchain, device, conformance and reliability tests."""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

SMALL_MODELS = Path(__file__).resolve().parents[1] / "models" / "small"


def _run_cache_dir(tmp_path_factory) -> Path:
    """This run's cache folder. Under pytest-xdist (`-n 2`) the workers share one, the parent of
    their own temporary folders: a kernel or plan one worker compiled is a hit for the other
    (entries are written to a temporary name and renamed into place, so concurrent writers of
    the same entry are safe)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "powerfusion-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory):
    """A per-run cache folder for this process and the processes it starts (CLI tests inherit
    POWERFUSION_CACHE_DIR). PF_TEST_CACHE_DIR names a folder to keep between runs instead."""
    from powerfusion import options
    path = Path(os.environ.get("PF_TEST_CACHE_DIR") or _run_cache_dir(tmp_path_factory))
    saved_env, saved = os.environ.get("POWERFUSION_CACHE_DIR"), options.current().cache_dir
    os.environ["POWERFUSION_CACHE_DIR"] = str(path)
    options.set_defaults(cache_dir=path)
    yield path
    options.set_defaults(cache_dir=saved)
    if saved_env is None:
        os.environ.pop("POWERFUSION_CACHE_DIR", None)
    else:
        os.environ["POWERFUSION_CACHE_DIR"] = saved_env


@functools.cache
def _compiled(model: str, target: str):
    from powerfusion.compiler import compile_model
    return compile_model(SMALL_MODELS / f"{model}.onnx", target)


@pytest.fixture(scope="session")
def compiled():
    """compiled(model, target) -> Plan: the bundled model models/small/<model>.onnx through
    `powerfusion compile`'s pipeline, once per test run for every test file that asks."""
    return _compiled


@functools.cache
def gpu_missing_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install 'powerfusion[cuda]')"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # CuPy without a driver raises CUDARuntimeError at first use
        return f"no usable CUDA device ({type(e).__name__})"
    return None


@functools.cache
def browser_missing_reason() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell")
    if any(shutil.which(n) for n in names):
        return None
    if importlib.util.find_spec("playwright") is not None:
        return None
    return "needs a headless Chromium (chromium on PATH or playwright)"


def pytest_configure(config):
    for line in ("gpu: needs an NVIDIA GPU with CuPy (skipped without one)",
                 "slow: long-running (minutes)",
                 "browser: needs a headless Chromium (skipped without one)"):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and (reason := gpu_missing_reason()):
            item.add_marker(pytest.mark.skip(reason=reason))
        if "browser" in item.keywords and (reason := browser_missing_reason()):
            item.add_marker(pytest.mark.skip(reason=reason))


def require_tool(name: str) -> str:
    """The path of a compiler the test needs. Without it the test skips, unless
    PF_REQUIRE_COMPILERS=1 (set by CI), where a missing compiler is a failure."""
    import os
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("PF_REQUIRE_COMPILERS") == "1":
        pytest.fail(f"{name} is required (PF_REQUIRE_COMPILERS=1) but not on PATH")
    pytest.skip(f"needs {name}")


@pytest.fixture
def nvcc() -> str:
    return require_tool("nvcc")


@pytest.fixture
def gxx() -> str:
    return require_tool("g++")
