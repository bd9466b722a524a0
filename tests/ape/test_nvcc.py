"""Ape's kernel source compiles with nvcc for sm_80 and sm_90, as NVRTC receives it (no GPU)."""
from __future__ import annotations

import re
import subprocess

import pytest

from powerfusion.ape import kernels
from conftest import require_tool


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile(arch, tmp_path):
    nvcc = require_tool("nvcc")
    src = tmp_path / "ape.cu"
    src.write_text(kernels.source())
    ptx = tmp_path / "ape.ptx"
    run = subprocess.run([nvcc, f"-arch={arch}", "--ptx", "-o", str(ptx), str(src)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx.read_text()))
    assert entries == set(kernels.KERNEL_NAMES)


def test_source_has_no_includes():
    # NVRTC in CuPy gets the same text; no header search path is needed
    assert "#include" not in kernels.source()
