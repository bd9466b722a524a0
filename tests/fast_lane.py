"""The fast lane: `pytest --fast` runs the unit tests, those that need no model compile, no
compiler, no device and no long search -- seconds per file -- so a change is checked in well
under a minute. The whole suite (model-level, toolchain, conformance, reliability) stays the
check before a merge.

A test file in one of FAST_FOLDERS is in the lane unless NOT_FAST names it; elsewhere only the
files of FAST_FILES are. Seconds are measured per file with `pytest --durations=0` on two
cores shared with other work (load about 8, so roughly four times an idle machine's)."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent

FAST_FOLDERS = ("ape", "frontend", "gir", "mlu", "perfmodel", "precision", "rewrite", "runtime", "templates", "viz")
FAST_FILES = ("test_layering.py", "test_fast_lane.py", "test_compile_cache.py", "test_plan_io_save.py",
              "backends/test_c_index.py", "backends/test_kernel_grid.py", "backends/test_reduce_accumulator.py",
              "backends/test_shifted_window.py",
              "ttile/test_dtype_names.py", "ttile/test_onnx_quant.py", "ttile/test_reference.py",
              "ttile/test_ttile_schedule.py", "ttile/test_ttype_quant.py")
# in a fast folder, but model-level, toolchain or long: file -> why (seconds at load 8)
NOT_FAST = {
    "ape/test_nvcc.py": "compiles with nvcc",
    "frontend/test_light_models.py": "imports the onnx package's CNNs (93 s)",
    "gir/test_fastexec.py": "property tests over many random graphs (134 s)",
    "mlu/test_emitter_models.py": "lowers whole models (142 s)",
    "perfmodel/test_search_parallel.py": "forks search worker processes (4 s at load 5)",
    "perfmodel/test_search_polish.py": "a polished search over many plans (4 s at load 5)",
    "precision/test_amp.py": "AMP on models, checked with onnxruntime (14 s)",
    "precision/test_integer_gemm.py": "integer GEMM models through onnxruntime (21 s)",
    "precision/test_qdq.py": "QDQ models through onnxruntime (43 s)",
    "rewrite/test_onepass.py": "one-pass rules searched on LayerNorm/softmax rows, nvcc (30 s)",
    "rewrite/test_property_lowered.py": "property tests over lowered random graphs (23 s)",
    "runtime/test_nvcc_check.py": "compiles with nvcc",
    "templates/test_templates_on_models.py": "templates over whole models (15 s)",
    "viz/test_browser.py": "a headless browser (42 s)",
}


def in_fast_lane(path: Path) -> bool:
    rel = path.resolve().relative_to(TESTS).as_posix()
    if rel in NOT_FAST:
        return False
    return rel in FAST_FILES or rel.split("/")[0] in FAST_FOLDERS


def left_out(path: Path) -> bool:
    """True for a test file (or folder) outside the lane: `pytest --fast` does not collect it."""
    path = Path(path).resolve()
    if path == TESTS or TESTS not in path.parents:
        return False
    rel = path.relative_to(TESTS)
    if path.is_dir():
        return not any(rel.as_posix() == f or f.startswith(rel.as_posix() + "/") for f in FAST_FILES) \
            and rel.parts[0] not in FAST_FOLDERS
    if not path.name.startswith("test_"):
        return False   # helpers and conftest files are collected as usual
    return not in_fast_lane(path)
