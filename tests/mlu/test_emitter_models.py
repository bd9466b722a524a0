"""Every memory-bound subgraph of every committed small model, emitted as BANG C and run on
the CPU under the bang_emu.h emulation, against numpy.

Per model: import, partition for mlu370, lower each memory-bound subgraph with its default
templates and rewrite it (powerfusion.templates.merge + powerfusion.rewrite.optimise), render it
with MLURenderer. All kernels of the model go into ONE translation unit with one host
`main` that runs a chosen subgraph (its kernels in order, through their emitted
`launch_<kernel>` host launchers), so g++ runs once per model (builds are cached by
content). Inputs are the real tensor values of the model on sample inputs (numpy
reference executor of the basic-op graph), and each output is compared with the value
that executor computes for it. The emulator checks NRAM/SRAM capacity and alignment,
waits on asynchronous copies and memory spaces; the output coverage check asserts that
the tasks together wrote every output byte.

Tolerances: float32 |got - want| <= 1e-4 * max(1, max |want|) + 1e-4 * |want| (reductions
sum in another order than numpy); integer and bool outputs exactly.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from harness import _build, _read_log  # noqa: E402

from powerfusion.names import sanitize  # noqa: E402
from powerfusion.backends.mlu.renderer import MLURenderer  # noqa: E402
from powerfusion.gir.interpreter import np_dtype  # noqa: E402
from powerfusion.gir.ir import Level  # noqa: E402

SMALL = ROOT / "models" / "small"
MODELS = sorted(p.stem for p in SMALL.glob("*.onnx"))


def _cache_key(name: str) -> str:
    """The model file and every source that shapes its GIR (all of powerfusion but the backends)."""
    h = hashlib.sha256((SMALL / f"{name}.onnx").read_bytes())
    for p in sorted((ROOT / "powerfusion").rglob("*.py")):
        if "backends" not in p.parts:
            h.update(p.as_posix().encode() + p.read_bytes())
    return h.hexdigest()[:24]


@lru_cache(maxsize=None)
def compiled(name: str):
    """(basic graph, feeds, [(subgraph, optimised GIR, buffer -> tensor)]), cached on disk by
    content: lowering and rewriting the models costs far more than emulating their kernels."""
    path = Path(tempfile.gettempdir()) / "pf_mlu_models" / f"{name}_{_cache_key(name)}.pkl"
    if path.exists():
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # a stale or partial cache entry is rebuilt
            pass
    result = _compile(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}")
    tmp.write_bytes(pickle.dumps(result))
    os.replace(tmp, path)
    return result


def _compile(name: str):
    from models import small_manifest
    from models.onnx_tools import TensorSpec, sample_inputs
    from powerfusion.pipeline.driver import CompileOptions, compile
    from powerfusion.templates.merge import MergePlan
    # the default template choice, rewritten (as `powerfusion inspect --gir` builds it)
    plan = compile(str(SMALL / f"{name}.onnx"), "mlu370", CompileOptions(choose="fewest-kernels", render=False))
    graph = plan.graph
    specs = [TensorSpec.from_json(d) for d in small_manifest()["models"][name]["inputs"]]
    feeds = sample_inputs(specs, seed=5)
    steps = []
    for step in plan.kernel_steps:
        names = MergePlan(step.subgraph, graph, "mlu370").names
        steps.append((step.subgraph, step.gir, {b: t for t, b in names.items()}))
    return graph, feeds, steps


def tensor_values(graph, feeds) -> dict[str, np.ndarray]:
    """Every tensor of the basic-op graph, computed by the numpy reference executor."""
    from powerfusion.frontend.numpy_exec import EXECUTORS
    env = dict(graph.constants)
    env.update({t.name: np.asarray(feeds[t.name]) for t in graph.inputs})
    for node in graph.nodes:
        out = graph.tensors[node.outputs[0]]
        y = EXECUTORS[type(node.op)](node.op, [env[i] for i in node.inputs], np.dtype(out.dtype))
        env[node.outputs[0]] = np.asarray(y).astype(out.dtype, copy=False).reshape(out.shape)
    return env


def _main(steps, kernels, ctype) -> str:
    """A host program: `prog DIR STEP` runs subgraph STEP's kernels on buffers read from DIR."""
    lines = ['#include "bang_emu.h"', "#include <string>", "#include <cstdio>", '#include "kernel.mlu"', "",
             "static void* buffer(const std::string& dir, const char* name, size_t bytes, bool in, bool out) {",
             "  void* p; cnrtMalloc(&p, bytes ? bytes : 1); pf_bang::name_gdram(p, name, out);",
             "  if (!in) { std::memset(p, 0xFF, bytes); return p; }",
             '  FILE* f = std::fopen((dir + "/" + name + ".bin").c_str(), "rb");',
             "  if (!f || std::fread(p, 1, bytes, f) != bytes) { std::fprintf(stderr, \"missing %s\\n\", name); "
             "std::exit(2); }",
             "  std::fclose(f); return p;", "}",
             "static void save(const std::string& dir, const char* name, void* p, size_t bytes) {",
             '  FILE* f = std::fopen((dir + "/out_" + name + ".bin").c_str(), "wb");',
             "  std::fwrite(p, 1, bytes, f); std::fclose(f);", "}", "",
             "int main(int argc, char** argv) {", "  std::string dir = argv[1]; int step = std::atoi(argv[2]);",
             "  pf_bang::set_output_dir(dir);", "  cnrtQueue_t queue; cnrtQueueCreate(&queue);", "  switch (step) {"]
    for n, (_, gir, _) in enumerate(steps):
        lines.append(f"  case {n}: {{")
        fed = set(gir.inputs) | {b for b, _ in gir.constants}
        var = {}
        for b in gir.buffers:
            if b.level != Level.GLOBAL:
                continue
            var[b.name] = f"g{len(var)}"
            nbytes = b.size * np_dtype(b.dtype).itemsize
            lines.append(f'    void* {var[b.name]} = buffer(dir, "{sanitize(b.name)}", {nbytes}, '
                         f'{str(b.name in fed).lower()}, {str(b.name in gir.outputs).lower()});')
        for k in kernels[n]:
            args = ", ".join(f"({ctype[dt]}*){var[b]}" for b, dt, _ in k.params)
            lines.append(f"    launch_{k.name}(queue, {args});")
        for o in gir.outputs:
            b = gir.buffer(o)
            lines.append(f'    save(dir, "{sanitize(o)}", {var[o]}, {b.size * np_dtype(b.dtype).itemsize});')
        lines += ["    break; }"]
    lines += ["  default: return 4;", "  }", "  cnrtQueueSync(queue);", "  pf_bang::finish();", "  return 0;", "}", ""]
    return "\n".join(lines)


def translation_unit(kernels) -> str:
    """All kernel files of a model in one source; the arenas sized for the largest kernel."""
    sources = [k.source for ks in kernels for k in ks]
    need = lambda macro: max([int(m) for s in sources for m in re.findall(rf"#define {macro} (\d+)", s)] or [64])
    return (f"#define PF_NRAM_BYTES {need('PF_NRAM_BYTES')}\n#define PF_SRAM_BYTES {need('PF_SRAM_BYTES')}\n"
            + "\n".join(sources))


def check_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    if want.dtype.kind == "f":
        w, g = want.astype(np.float64), got.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


@pytest.mark.parametrize("name", MODELS)
def test_model_subgraphs_run_under_bang_emulation(name):
    graph, feeds, steps = compiled(name)
    assert steps, f"{name}: no memory-bound subgraphs"
    r = MLURenderer()
    kernels = [r.render(gir) for _, gir, _ in steps]
    exe = _build(translation_unit(kernels), _main(steps, kernels, r.ctype))
    env = tensor_values(graph, feeds)
    forms = set()
    for n, (sub, gir, tensor_of) in enumerate(steps):
        consts = dict(gir.constants)
        with tempfile.TemporaryDirectory(prefix="pf_mlu_model_") as work:
            for b in set(gir.inputs) | set(consts):
                value = consts[b] if b in consts else env[tensor_of[b]]
                np.ascontiguousarray(np.asarray(value).astype(np_dtype(gir.buffer(b).dtype))).tofile(
                    os.path.join(work, f"{sanitize(b)}.bin"))
            proc = subprocess.run([str(exe), work, str(n)], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"{name}/{sub.name}: {proc.stderr.strip()[-2000:]}"
            log = _read_log(Path(work))
            assert not log.uncovered(), f"{name}/{sub.name}: output bytes never written: {log.uncovered()}"
            for o in gir.outputs:
                b = gir.buffer(o)
                got = np.fromfile(os.path.join(work, f"out_{sanitize(o)}.bin"), dtype=np_dtype(b.dtype))
                want = np.asarray(env[tensor_of[o]]).reshape(-1)
                check_close(got, want.astype(got.dtype) if want.dtype != got.dtype else want,
                            f"{name}/{sub.name}: output {o} (tensor {tensor_of[o]})")
        forms.update(re.findall(r"BANG C for MLU370 \((\w+)", "".join(k.source for k in kernels[n])))
    assert "pipelined" in forms, f"{name}: no kernel used the pipelined form ({forms})"
