"""Convolution layers of real models, device time by CUDA-graph replay: our cuDNN route
(powerfusion/backends/cuda/cudnn_conv.py), our im2col + cuBLAS route (library.conv_into) and
torch's conv (cuDNN; heuristics and `cudnn.benchmark` autotuning), fp32 (TF32 off on every side),
fp16 and bf16, batch 1 and 8, with the bias an exported model carries (BatchNorm folded in).

Layers (torchvision shapes at 224x224): ResNet-18's 7x7 stride-2 stem, 3x3 convs of its first
and last stage and a stride-2 3x3; ResNet-50's 1x1 reduce / expand convs and a 3x3 of stage 3;
depthwise 3x3 (MobileNetV2, stride 1 and 2) and 5x5 (EfficientNet-B0); a MobileNet 1x1.
Depthwise convs below the ridge point run as GIR in a session; they are timed here as library
calls all the same, since a session sends those above it (and all of them without GIR) here.

Each impl is captured once over enough input sets to exceed twice the L2 (every call reads
DRAM) and replayed; rows give microseconds per call, the route's own notes (the cuDNN engine,
why im2col declined), and the cuDNN graph's build time.

    PYTHONPATH=$PWD python3 benchmarks/bench_conv.py [--out DIR] [--budget-s 200] [--only resnet]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import RESULTS_DIR, input_sets_needed, l2_bytes, run_metadata, time_cupy  # noqa: E402

# name: (C_in, H, W, C_out, kernel, stride, pad, group)
LAYERS = {
    "resnet18.stem7x7s2": (3, 224, 224, 64, 7, 2, 3, 1),
    "resnet18.layer1.3x3": (64, 56, 56, 64, 3, 1, 1, 1),
    "resnet18.layer2.3x3s2": (64, 56, 56, 128, 3, 2, 1, 1),
    "resnet18.layer4.3x3": (512, 7, 7, 512, 3, 1, 1, 1),
    "resnet50.layer1.1x1reduce": (256, 56, 56, 64, 1, 1, 0, 1),
    "resnet50.layer1.1x1expand": (64, 56, 56, 256, 1, 1, 0, 1),
    "resnet50.layer3.1x1reduce": (1024, 14, 14, 256, 1, 1, 0, 1),
    "resnet50.layer3.3x3": (256, 14, 14, 256, 3, 1, 1, 1),
    "mobilenetv2.dw3x3": (144, 56, 56, 144, 3, 1, 1, 144),
    "mobilenetv2.dw3x3s2": (96, 112, 112, 96, 3, 2, 1, 96),
    "efficientnet_b0.dw5x5": (240, 28, 28, 240, 5, 1, 2, 240),
    "mobilenetv2.1x1": (32, 112, 112, 16, 1, 1, 0, 1),
}
DTYPES = ("float32", "float16", "bfloat16")
BATCHES = (1, 8)
IMPLS = ("ours-cudnn", "ours-im2col", "torch", "torch-benchmark")


def _shape(layer, batch, dtype):
    from powerfusion.backends.cuda.cudnn_conv import ConvShape
    c, h, w, m, k, s, p, g = LAYERS[layer]
    return ConvShape((batch, c, h, w), (m, c // g, k, k), True, (s, s), (p, p), (p, p), (1, 1), dtype)


def _arrays(shape, sets):
    """`sets` (x, w, b, y) CuPy sets; bf16 as uint16 bits (as the session's arena holds it)."""
    import cupy
    import ml_dtypes
    rng = np.random.default_rng(0)
    host_dtype = ml_dtypes.bfloat16 if shape.dtype == "bfloat16" else np.dtype(shape.dtype)

    def dev(a):
        a = a.astype(host_dtype)
        return cupy.asarray(a.view(np.uint16) if shape.dtype == "bfloat16" else a)
    w = dev(rng.standard_normal(shape.w) / np.sqrt(np.prod(shape.w[1:])))
    b = dev(rng.standard_normal(shape.w[0]))
    out = []
    for _ in range(sets):
        x = dev(rng.standard_normal(shape.x, dtype=np.float32))
        y = cupy.empty(shape.out, dtype=x.dtype)
        out.append((x, w, b, y))
    return out


def _time_captured(fn, arg_sets, bind) -> dict:
    """Device time per call by replaying one captured graph of fn over every arg set (`bind`
    gives the handles the capture stream first), and the per-call latency."""
    t = time_cupy(fn, arg_sets, latency_calls=30, bind=bind)
    return {"device_time_s": t.device_time_s, "latency_s": t.latency_s, "method": t.method}


def _ours_cudnn(shape, arg_sets) -> dict:
    import cupy
    from powerfusion.backends.cuda import cudnn_conv
    t0 = time.perf_counter()
    conv = cudnn_conv.build(shape, cupy.cuda.Device().id)
    build_s = time.perf_counter() - t0
    ws = cupy.empty(max(conv.workspace_bytes, 1), dtype=np.uint8)
    row = _time_captured(lambda x, w, b, y: conv(x, w, b, y, ws), arg_sets, lambda s: conv.bind(s.ptr))
    return {**row, "build_s": build_s, "note": f"{conv.plan_name}; bias {'fused' if conv.fused_bias else 'kernel'};"
            f" workspace {conv.workspace_bytes} B; plans timed at build (us): "
            + ", ".join(f"{i}: {t:.1f}" for i, t in conv.times_us.items())
            + "; variants (us): " + ", ".join(f"{k} {t:.1f}" for k, t in conv.tried.items())}


@functools.cache
def _blas():
    from powerfusion.backends.cuda.blas import Blas
    return Blas()


def _ours_im2col(shape, arg_sets) -> dict:
    import cupy
    from powerfusion.backends.cuda import library
    blas, cols = _blas(), {}
    blas.bind(cupy.cuda.get_current_stream())
    logical = "bfloat16" if shape.dtype == "bfloat16" else None
    x, w, b, y = arg_sets[0]
    kw = dict(strides=shape.strides, pads=shape.pad_begins + shape.pad_ends, dilations=shape.dilations,
              group=shape.x[1] // shape.w[1], logical_dtype=logical)
    if not library.conv_into(blas, x, w, b, y, cols, **kw):
        return {"error": "im2col path declines this conv (the session runs library.conv eagerly, uncaptured)"}
    return _time_captured(lambda x, w, b, y: library.conv_into(blas, x, w, b, y, cols, **kw), arg_sets, blas.bind)


def _torch(shape, arg_sets, benchmark: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from harness import time_torch
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = benchmark
    dt = getattr(torch, shape.dtype)

    def as_torch(a):   # bf16 bits travel as int16 (DLPack has no uint16 view into bfloat16 in torch)
        return torch.from_dlpack(a.view(np.int16)).view(dt) if shape.dtype == "bfloat16" else torch.from_dlpack(a)
    sets = [tuple(as_torch(a) for a in s[:3]) for s in arg_sets]
    group = shape.x[1] // shape.w[1]

    def fn(x, w, b):
        return F.conv2d(x, w, b, shape.strides, shape.pad_begins, shape.dilations, group)
    t = time_torch(fn, sets, latency_calls=30)
    return {"device_time_s": t.device_time_s, "latency_s": t.latency_s, "method": t.method}


def bench(layer, batch, dtype) -> list[dict]:
    import cupy
    shape = _shape(layer, batch, dtype)
    item = np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
    per_set = item * (int(np.prod(shape.x)) + int(np.prod(shape.w)) + int(np.prod(shape.out)))
    arg_sets = _arrays(shape, input_sets_needed(per_set, l2_bytes(), cap=16))
    flops = 2 * int(np.prod(shape.out)) * int(np.prod(shape.w[1:]))
    rows = []
    for impl in IMPLS:
        base = {"layer": layer, "batch": batch, "dtype": dtype, "impl": impl, "x": list(shape.x), "w": list(shape.w),
                "flops": flops}
        try:
            if impl == "ours-cudnn":
                r = _ours_cudnn(shape, arg_sets)
            elif impl == "ours-im2col":
                r = _ours_im2col(shape, arg_sets)
            else:
                r = _torch(shape, arg_sets, benchmark=impl == "torch-benchmark")
        except Exception as e:
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append({**base, **r})
    del arg_sets
    cupy.get_default_memory_pool().free_all_blocks()
    return rows


MODELS = ("resnet_small", "efficientnet_small")   # committed models/small/*.onnx with convolutions


def bench_model(name: str) -> list[dict]:
    """One committed model as a cuda_graph session with the cuDNN route and without it (the
    frontend made unimportable): device time of one replay (median of 30), and the routes."""
    import unittest.mock
    from bench_models import graph_replay_times
    from powerfusion import InferenceSession
    from powerfusion.backends.cuda import cudnn_conv
    path = Path(__file__).resolve().parents[1] / "models" / "small" / f"{name}.onnx"
    rows, outs = [], {}
    for impl in ("session-cudnn", "session-im2col"):
        no_cudnn = unittest.mock.patch.object(cudnn_conv, "load", lambda: (None, "switched off for this row"))
        with (no_cudnn if impl == "session-im2col" else contextlib.nullcontext()):
            t0 = time.perf_counter()
            sess = InferenceSession(str(path), target="cuda", options={"cuda_graph": True})
            build_s = time.perf_counter() - t0
        feeds = {i.name: np.random.default_rng(0).standard_normal([int(d) for d in i.shape]).astype(np.float32)
                 for i in sess.get_inputs()}
        outs[impl] = sess.run(None, feeds)[0]
        runner = sess._executor
        routes = list(runner.conv_routes.values())
        rows.append({"layer": name, "batch": int(next(iter(feeds.values())).shape[0]), "dtype": "float32",
                     "impl": impl, "device_time_s": statistics.median(graph_replay_times(sess)), "build_s": build_s,
                     "convs": len(routes), "convs_cudnn": len(runner.convs),
                     "graph_pieces": [k for k, _ in runner._cuda_graph]})
    a, b = (np.asarray(o, np.float64) for o in outs.values())
    rows[0]["max_rel_diff_vs_im2col"] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    return rows


def _model_cells(r) -> str:
    if "device_time_s" not in r:
        return f"- | {r.get('error', '')} | | "
    diff = f"{r['max_rel_diff_vs_im2col']:.2g}" if "max_rel_diff_vs_im2col" in r else ""
    return f"{r['device_time_s'] * 1e6:.1f} | {r['convs_cudnn']} of {r['convs']} | {r['build_s']:.1f} | {diff}"


def markdown(rows, meta) -> str:
    head = [f"# conv", "", f"{meta.get('device', '?')}, {meta['date']}, commit {meta['git_commit']}, "
            f"cuDNN {meta.get('cudnn', '?')} (frontend {meta.get('cudnn_frontend', '?')}), torch {meta.get('torch', '?')}.",
            "Device microseconds per call by CUDA-graph replay (inputs beyond L2); fp32 without TF32 everywhere; "
            "the bias of an exported model (BatchNorm folded) included.", "",
            "'ours' is the route a session keeps (the faster of the two, timed at build); "
            "'x torch' = torch (heuristics) time / ours.", "",
            "| layer | batch | dtype | ours-cudnn | ours-im2col | torch | torch-benchmark | ours | x torch | cuDNN engine |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["layer"], r.get("batch"), r.get("dtype")), {})[r["impl"]] = r
    lines, ratios = [], []
    models = [r for r in rows if r["impl"].startswith("session-")]
    by = {k: v for k, v in by.items() if not any(i.startswith("session-") for i in v)}
    for (layer, batch, dtype), impls in by.items():
        us = {k: (f"{v['device_time_s'] * 1e6:.1f}" if "device_time_s" in v else "-") for k, v in impls.items()}
        cud, torch_t = impls.get("ours-cudnn", {}), impls.get("torch", {})
        ours = min((impls[i]["device_time_s"] for i in ("ours-cudnn", "ours-im2col")
                    if "device_time_s" in impls.get(i, {})), default=None)
        ratio = ""
        if ours and "device_time_s" in torch_t:
            ratios.append(torch_t["device_time_s"] / ours)
            ratio = f"{ratios[-1]:.2f}x"
        engine = cud.get("note", cud.get("error", "")).split(";")[0]
        lines.append(f"| {layer} | {batch} | {dtype} | " + " | ".join(us.get(i, "-") for i in IMPLS)
                     + f" | {'-' if ours is None else f'{ours * 1e6:.1f}'} | {ratio} | {engine} |")
    tail = [""]
    if ratios:
        tail.append(f"Geomean speed of ours over torch (heuristics): "
                    f"{float(np.exp(np.mean(np.log(ratios)))):.2f}x over {len(ratios)} rows "
                    f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x). '-' = not run; the JSON says why.")
    if models:
        tail += ["", "Whole committed models (models/small), fp32 cuda_graph sessions, device time of one replay:", "",
                 "| model | batch | route | device us | convs on cuDNN | build s | max rel diff |", "|---|---:|---|---:|---:|---:|---:|"]
        for r in models:
            tail.append(f"| {r['layer']} | {r.get('batch', '-')} | {r['impl']} | " + _model_cells(r) + " |")
    tail += [""] + [f"- {n}" for n in meta.get("notes", [])]
    return "\n".join(head + lines + tail) + "\n"


def main(argv=None) -> int:
    import json
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--only", default="")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--models", action="store_true", help="also whole committed models, with and without cuDNN")
    args = ap.parse_args(argv)
    from powerfusion.backends.cuda import cudnn_conv
    cudnn, why = cudnn_conv.load()
    t_end, rows = time.perf_counter() + args.budget_s, []
    meta = run_metadata(suite="conv", cudnn=cudnn.backend_version() if cudnn else why,
                        cudnn_frontend=getattr(cudnn, "__version__", None))
    out = Path(args.out) if args.out else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)

    def save():   # after every case, so a run cut short keeps what it measured
        (out / "conv.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (out / "conv.md").write_text(markdown(rows, meta))
    for dtype in args.dtypes.split(","):
        for batch in BATCHES:
            for layer in LAYERS:
                if args.only not in layer:
                    continue
                if time.perf_counter() > t_end:
                    rows.append({"layer": layer, "batch": batch, "dtype": dtype, "impl": "all",
                                 "error": f"not reached within --budget-s {args.budget_s}"})
                    continue
                rows += bench(layer, batch, dtype)
                save()
                for r in rows[-len(IMPLS):]:
                    print(f"{layer:28s} b{batch} {dtype:8s} {r['impl']:16s} "
                          + (f"{r['device_time_s'] * 1e6:9.1f} us" if "device_time_s" in r else r.get("error", "")),
                          flush=True)
    for name in MODELS if args.models else ():
        try:
            rows += bench_model(name)
        except Exception as e:
            traceback.print_exc()
            rows.append({"layer": name, "impl": "session-cudnn", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        for r in rows[-2:]:
            print(r, flush=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
