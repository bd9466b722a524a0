"""backends/cuda/decode_attention.py: split-KV decode attention (MHA and grouped-query).

CPU: the matcher turns a decode step (fp32, bf16; MHA and GQA) into one Attention op whose
numpy evaluation matches float64; the kernel's algorithm (chunk partials in the log2 domain,
then the combine) in numpy matches float64 within float32 rounding (2e-5 relative to the
output's range, also for scores offset by 1e3 and KV lengths that are no multiple of the
chunk); the emitted source compiles with nvcc for every dtype and group. GPU: the kernel
against float64 numpy: fp32 2e-5, fp16 2e-3, bf16 1e-2 relative (one rounding of the output,
operands exact in float32), launched repeatedly (the arrival counters re-arm) and through a
session with CUDA-graph capture.
"""
from __future__ import annotations

import ctypes
import importlib.util
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from powerfusion.backends.cuda import decode_attention as da
from powerfusion.basic import Attention
from powerfusion.frontend import import_model, run_basic_graph
from powerfusion.frontend.attention import fuse_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coop_emulator import build

# the benchmark's cases, under their own name (tests/backends has a gir_cases module too)
_spec = importlib.util.spec_from_file_location("bench_gir_cases",
                                               Path(__file__).resolve().parents[2] / "benchmarks" / "gir_cases.py")
gir_cases = sys.modules.setdefault("bench_gir_cases", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(gir_cases)

TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}


def reference(q, k, v, scale):
    """softmax(q k^T s) v in float64; q [heads, G, D], k and v [heads, T, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, 1, 2) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def operands(heads, group, t, d, offset=0.0, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, group, d)).astype(np.float32)
    k = (rng.standard_normal((heads, t, d)) + offset).astype(np.float32)
    v = rng.standard_normal((heads, t, d)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("group,t,chunk,offset", [(1, 1024, 64, 0.0), (4, 1000, 64, 0.0), (4, 4096, 512, 0.0),
                                                  (8, 777, 128, 0.0), (1, 3000, 256, 1e3 / 8)])
def test_split_kv_algorithm_matches_float64(group, t, chunk, offset):
    q, k, v = operands(3, group, t, 64, offset)
    scale = 1 / math.sqrt(64)
    assert rel(da.split_kv_reference(q, k, v, scale, chunk), reference(q, k, v, scale)) < TOL["float32"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gqa", [False, True])
def test_decode_step_is_one_attention_op(dtype, gqa):
    """The GPT-2 / LLaMA decode rows of the benchmark: every node becomes one Attention (the head
    merge written by it) whose numpy evaluation matches float64 (bf16: the graph's rounding of
    the probabilities and the output, 1e-2)."""
    case = (gir_cases.decode_attention_gqa("t", 2, 8, 2, 300, d=32, dtype=dtype) if gqa
            else gir_cases.decode_attention("t", 2, 3, 300, d=32, dtype=dtype))
    graph = import_model(case.model)
    assert fuse_attention(graph) == 1
    (node,) = graph.nodes
    assert isinstance(node.op, Attention) and node.outputs == ("y",)
    shape, why = da.decode_shape(graph, node)
    assert shape is not None, why
    assert (shape.group, shape.kv_len, shape.head_size) == ((4 if gqa else 1), 300, 32)
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, (s, _) in case.inputs.items()}
    if dtype == "bfloat16":
        import ml_dtypes
        feeds = {n: a.astype(ml_dtypes.bfloat16) for n, a in feeds.items()}
    got = run_basic_graph(graph, feeds)["y"]
    q, k, v = (np.asarray(feeds[n], np.float32).reshape(shape.heads, -1, 32) for n in "qkv")
    want = reference(q, k, v, 1 / math.sqrt(32)).reshape(got.shape)
    assert rel(got.astype(np.float32), want) < (TOL["float32"] * 5 if dtype == "float32" else 1e-2)


def test_fp32_attention_with_many_query_rows_is_not_fused():
    """16 query rows per KV head: more than the decode kernel takes, and fp32 has no other fused
    route, so the graph stays decomposed (GIR kernels)."""
    graph = import_model(gir_cases.decode_attention_gqa("t", 1, 32, 2, 64, d=32).model)
    assert fuse_attention(graph) == 0


@pytest.mark.parametrize("heads,group,t,d,want", [(48, 1, 1024, 64, 96), (48, 1, 4096, 64, 384),
                                                   (48, 1, 32768, 64, 2992), (32, 4, 1024, 128, 128),
                                                   (32, 4, 32768, 128, 1024), (32, 8, 32768, 128, 256),
                                                   (32, 1, 1025, 128, 144), (32, 1, 1024, 128, 128)])
def test_chunk_rows_fill_one_wave_within_shared_memory(heads, group, t, d, want):
    """One wave of resident blocks (4 per SM for one query row, 2 for GQA groups), the rows split
    evenly in 16-row steps, unless the scores would overflow shared memory."""
    shape = da.DecodeShape(heads, group, t, d, "float32", 0.1)
    rows = da.chunk_rows(shape, 132)
    assert rows == want
    fits = math.ceil(t / rows) * heads <= da.resident_blocks(shape) * 132
    assert fits or rows == da._max_chunk(shape)
    assert rows % da.CHUNK_ALIGN == 0 or rows == da._max_chunk(shape)
    floats = group * rows + (da.THREADS // 32) * group * d + 2 * group + 1
    assert floats <= da.SHARED_FLOATS


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (8, 128), (2, 16)])
def test_source_compiles_with_nvcc(dtype, group, d):
    from powerfusion.backends.cuda.runtime import compile_check_nvcc
    shape = da.DecodeShape(6, group, 5000, d, dtype, 0.125)
    compile_check_nvcc(da.decode_source(shape, da.chunk_rows(shape, 132)), arch="sm_90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("group,d", [(1, 64), (1, 128), (2, 128), (4, 128), (8, 128), (8, 64)])
def test_registers_fit_the_resident_blocks_without_spills(dtype, group, d, tmp_path):
    """__launch_bounds__(THREADS, resident_blocks) caps the registers; ptxas must not spill."""
    import subprocess
    shape = da.DecodeShape(48, group, 32768, d, dtype, 0.125)
    src = tmp_path / "k.cu"
    src.write_text(da.decode_source(shape, da.chunk_rows(shape, 132)))
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-o",
                           str(tmp_path / "k.cubin"), str(src)], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in proc.stderr, proc.stderr


def _device_array(x, dtype):
    import cupy
    if dtype == "bfloat16":
        import ml_dtypes
        return cupy.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    return cupy.asarray(np.asarray(x, np.float32).astype(dtype))


def _host(y, dtype):
    if dtype == "bfloat16":
        import ml_dtypes
        return y.get().view(ml_dtypes.bfloat16).astype(np.float32)
    return y.get().astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads,group,t,d", [(48, 1, 1024, 64), (8, 4, 4093, 128), (4, 8, 33000, 128),
                                             (3, 2, 50, 32), (2, 1, 70000, 64)])
def test_kernel_matches_float64(dtype, heads, group, t, d):
    import cupy
    q, k, v = operands(heads, group, t, d, seed=t)
    q, k, v = (np.asarray(a.astype(np.float32)) for a in (q, k, v))
    if dtype != "float32":   # the operands as the kernel sees them
        rounded = [_host(_device_array(a, dtype), dtype) for a in (q, k, v)]
        q, k, v = rounded
    scale = 1 / math.sqrt(d)
    run = da.DecodeAttention(da.DecodeShape(heads, group, t, d, dtype, scale))
    dq, dk, dv = (_device_array(a, dtype) for a in (q, k, v))
    out = cupy.zeros_like(dq)
    want = reference(q, k, v, scale)
    for _ in range(3):   # the last block of each head re-arms its counter
        out.fill(0)
        run(dq, dk, dv, out)
        assert rel(_host(out, dtype).reshape(want.shape), want) < TOL[dtype]
    assert int(run.arrivals.sum().get()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [False, True])
def test_session_runs_the_decode_kernel_captured(gqa):
    import powerfusion
    case = (gir_cases.decode_attention_gqa("t", 2, 32, 8, 2048) if gqa
            else gir_cases.decode_attention("t", 4, 12, 2048))
    rng = np.random.default_rng(5)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, (s, _) in case.inputs.items()}
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(case.model.SerializeToString(), target="cuda")
        got = sess.run(None, feeds)[0]
        again = sess.run(None, feeds)[0]
    assert len(sess._executor.decodes) == 1 and not sess._executor.attentions
    d = feeds["q"].shape[-1]
    heads = int(np.prod(feeds["k"].shape[:2]))
    want = reference(*(feeds[n].reshape(heads, -1, d) for n in "qkv"), 1 / math.sqrt(d))
    assert rel(got.reshape(want.shape), want) < TOL["float32"] and rel(again.reshape(want.shape), want) < TOL["float32"]


def _host_operand(x, dtype):
    """x as the kernel's operand type on the host (bf16 as bit patterns) and as float32 values."""
    if dtype == "bfloat16":
        import ml_dtypes
        b = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
        return b.view(np.uint16).copy(), b.astype(np.float32)
    a = np.asarray(x, np.float32).astype(dtype)
    return a, a.astype(np.float32)


def _emulated(shape: da.DecodeShape, sm_count: int, q, k, v, workdir, launches=2, tails=None):
    """The kernel's own source run on the CPU (coop_emulator.py), `launches` times; `tails`:
    (k_tail, v_tail) where shape.tail > 0."""
    chunk = da.chunk_rows(shape, sm_count)
    elem = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}[shape.dtype]
    params = [(f"const {elem}*", True)] * 3 + [(f"{elem}*", True), ("float*", True), ("unsigned*", True),
                                               ("int", False), ("float", False)] + [(f"const {elem}*", True)] * 2
    launch = build(da.decode_source(shape, chunk), "pf_decode_attention", params, workdir)
    chunks = math.ceil(shape.kv_len / chunk)
    part = np.zeros(shape.heads * chunks * shape.group * (shape.head_size + 2), np.float32)
    arrivals = np.zeros(shape.heads, np.uint32)
    out = np.zeros_like(q)
    outs = []
    for _ in range(launches):
        out[...] = 0
        launch([q, k, v, out, part, arrivals, ctypes.c_int(shape.kv_len),
                ctypes.c_float(shape.scale * math.log2(math.e)), *(tails or (k, v))], (chunks, shape.heads), da.THREADS)
        outs.append(out.copy())
    return outs, arrivals, chunks


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
@pytest.mark.parametrize("dtype,heads,group,t,d,sm_count", [
    ("float32", 2, 1, 300, 64, 1),       # 2 chunks of 256 (2 tiles), the last partial; 4 threads per output
    ("float32", 2, 4, 1500, 128, 1),     # chunks of 1024: 16 tiles of 64 rows
    ("float32", 1, 8, 2000, 128, 1),     # G = 8: one shuffle-free row per warp step
    ("float32", 2, 1, 100, 8, 1),        # a row is 2 packs: 8 threads per output in the combine
    ("bfloat16", 3, 1, 700, 64, 2),
    ("float16", 2, 2, 333, 32, 2)])
def test_kernel_source_on_the_cpu_matches_float64(dtype, heads, group, t, d, sm_count, tmp_path):
    """CPU numerics of the CUDA source itself: every block, the last-block combine and the
    counter re-arm; tolerance as on the GPU (one rounding of the output for fp16 / bf16)."""
    rng = np.random.default_rng(t)
    (q, qf), (k, kf), (v, vf) = (_host_operand(rng.standard_normal(s), dtype)
                                 for s in ((heads, group, d), (heads, t, d), (heads, t, d)))
    shape = da.DecodeShape(heads, group, t, d, dtype, 1 / math.sqrt(d))
    outs, arrivals, chunks = _emulated(shape, sm_count, q, k, v, tmp_path)
    assert chunks > 1
    want = reference(qf, kf, vf, shape.scale)
    for out in outs:
        got = _host_operand(out, dtype)[1] if dtype != "bfloat16" else _bf16_values(out)
        assert rel(got, want) < TOL[dtype]
    assert not arrivals.any()   # re-armed by each head's last block


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
@pytest.mark.parametrize("dtype,heads,group,t,tail,d", [
    ("float32", 2, 1, 300, 1, 64),       # the new row in the last, partial chunk (chunks of 256)
    ("float16", 1, 4, 1024, 1, 128),     # the new row alone in the second chunk (chunks of 1024)
    ("float32", 1, 8, 125, 6, 128)])     # 6 rows appended across the boundary of chunks of 128
def test_kernel_source_reads_appended_rows_in_place(dtype, heads, group, t, tail, d, tmp_path):
    """Attention.kv_tail on the CPU: the cache [heads, t, D] and the rows after it [heads, tail, D]
    in two arrays give softmax over their concatenation (float64), tolerance as above."""
    rng = np.random.default_rng(t + tail)
    (q, qf), (k, kf), (v, vf), (kt, ktf), (vt, vtf) = (
        _host_operand(rng.standard_normal(s), dtype)
        for s in ((heads, group, d), (heads, t, d), (heads, t, d), (heads, tail, d), (heads, tail, d)))
    kt, vt = kt * 1, vt * 1
    kt[:, -1] *= 4   # a row that dominates the softmax: a misplaced tail cannot hide
    ktf = _host_operand(kt, dtype)[1] if dtype != "bfloat16" else ktf
    shape = da.DecodeShape(heads, group, t + tail, d, dtype, 1 / math.sqrt(d), tail)
    outs, arrivals, chunks = _emulated(shape, 1, q, k, v, tmp_path, tails=(kt, vt))
    assert chunks > 1
    want = reference(qf, np.concatenate([kf, ktf], 1), np.concatenate([vf, vtf], 1), shape.scale)
    for out in outs:
        assert rel(_host_operand(out, dtype)[1], want) < TOL[dtype]
    assert not arrivals.any()


def _bf16_values(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def decode_folder(tmp_path_factory):
    """The GQA decode row compiled for CUDA into a folder (powerfusion/artefact.py)."""
    from powerfusion.cli import main
    root = tmp_path_factory.mktemp("decode")
    case = gir_cases.decode_attention_gqa("t", 2, 32, 8, 1000)
    (root / "decode.onnx").write_bytes(case.model.SerializeToString())
    assert main(["-q", "compile", str(root / "decode.onnx"), "-o", str(root / "out"), "--target", "cuda"]) == 0
    return case, root / "out"


def test_compiled_folder_holds_one_attention_step(decode_folder):
    import json
    _, out = decode_folder
    steps = json.loads((out / "plan.json").read_text())["steps"]
    assert [(s["kind"], s.get("op")) for s in steps] == [("library", "attention")]


@pytest.mark.gpu
def test_compiled_folder_runs_the_decode_kernel(decode_folder):
    import powerfusion
    case, out = decode_folder
    rng = np.random.default_rng(9)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, (s, _) in case.inputs.items()}
    sess = powerfusion.InferenceSession(str(out), providers=["CUDAExecutionProvider"])
    got = sess.run(None, feeds)[0]
    want = reference(*(feeds[n].reshape(16, -1, 128) for n in "qkv"), 1 / math.sqrt(128))
    assert rel(got.reshape(want.shape), want) < TOL["float32"]
    runner = sess._executor
    assert any(step[0] == "library" and step[3] is not None for step in runner.steps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,heads,group,t,tail,d", [("float16", 32, 1, 1024, 1, 128),
                                                        ("bfloat16", 8, 4, 4095, 1, 128),
                                                        ("float32", 6, 8, 300, 5, 64)])
def test_kernel_reads_appended_rows_on_the_gpu(dtype, heads, group, t, tail, d):
    """The cache and the rows after it as separate arrays (Attention.kv_tail) against float64
    softmax over their concatenation; tolerances as test_kernel_matches_float64."""
    import cupy
    rng = np.random.default_rng(t)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((heads, group, d), (heads, t, d), (heads, t, d), (heads, tail, d), (heads, tail, d))]
    if dtype != "float32":
        arrays = [_host(_device_array(a, dtype), dtype) for a in arrays]
    q, k, v, kt, vt = arrays
    shape = da.DecodeShape(heads, group, t + tail, d, dtype, 1 / math.sqrt(d), tail)
    run = da.DecodeAttention(shape)
    dq, dk, dv, dkt, dvt = (_device_array(a, dtype) for a in arrays)
    out = cupy.zeros_like(dq)
    assert "v_tail" in run.misfit(dq, dk, dv, out, dkt, dk)   # a tail of the wrong size is refused
    run(dq, dk, dv, out, dkt, dvt)
    want = reference(q, np.concatenate([k, kt], 1), np.concatenate([v, vt], 1), shape.scale)
    assert rel(_host(out, dtype).reshape(want.shape), want) < TOL[dtype]


@pytest.mark.gpu
def test_session_attends_over_the_cache_and_new_rows_in_place():
    """A decode step's Concat(cache, new) -> attention: one split-KV launch reading both (no
    Concat kernel), captured; against the interpreter on the unfused graph, fp16 2e-3."""
    import powerfusion
    from tests.unit.frontend.test_kv_append import _feeds, _model
    model = _model(rows=1)
    feeds = _feeds(model)
    want = run_basic_graph(import_model(model), feeds)["y"]
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(model.SerializeToString(), target="cuda")
        got, again = sess.run(None, feeds)[0], sess.run(None, feeds)[0]
    (route,) = sess._executor.decodes.values()
    assert route.shape.tail == 1 and not sess._executor.attentions and not sess._executor.plan.kernel_steps
    assert rel(got, want) < 2e-3 and rel(again, want) < 2e-3
