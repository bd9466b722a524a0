"""Markers: `gpu` tests skip without CuPy and a CUDA device; `browser` tests skip without a
headless Chromium; `slow` tests run unless `-m "not slow"` deselects them."""
from __future__ import annotations

import functools
import importlib.util
import shutil

import pytest


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
