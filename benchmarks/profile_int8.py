"""Where int8's time goes on the GPU: the GEMMs alone, then BERT-base-like layers kernel by kernel.

    PYTHONPATH=$PWD python3 benchmarks/profile_int8.py --out DIR [--layers 1] [--shapes 1x128,8x128]

1. GEMMs alone, at BERT-base's weight shapes (N x K = 768 x 768, 3072 x 768, 768 x 3072) for
   M = 128, 1024, 4096 rows: cuBLAS fp16 (CuPy's matmul, fp32 accumulation), our int8 route
   (int8_gemm.Int8Gemm: cublasGemmStridedBatchedEx, int32 out, TN layout) and cuBLASLt int8 with
   its own heuristic pick (int32 out; and int8 out, the scale in the epilogue). Device time per
   GEMM: median over 20 samples of 50 back-to-back calls between two events.
2. Whole layers (bench_precision.bert_base_like, `--layers`, each `--shapes` batch x seq): our
   fp16 and int8 variants as bench_precision names them (int8-static: onnxruntime's default Q/DQ
   on every op; int8-gemms: Q/DQ only around the GEMMs with constant weights; "+fp16": AMP on
   the float parts), each one CUDA-graph replay profiled kernel by kernel (kernel_profile.py).
Writes DIR/int8_profile.json as it goes (a later stage failing keeps the earlier ones).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES_NK = ((768, 768), (3072, 768), (768, 3072))
_R_8I, _R_32I, _R_32F, _COMPUTE_32I = 3, 10, 0, 72
_DESC_TRANSA = 3


def _time(fn, samples: int = 20, per_sample: int = 50) -> float:
    import cupy
    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(per_sample):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / per_sample)
    return statistics.median(times)


class _LtInt8:
    """One cuBLASLt int8 TN GEMM (row-major out[m, n] = a[m, k] @ w[n, k]^T), heuristic pick."""

    def __init__(self, lt, m: int, n: int, k: int, out_type: int):
        from powerfusion.backends.cuda.blaslt import WORKSPACE_BYTES, _Heuristic
        lib, self.lt = lt.lib, lt
        self.desc = ctypes.c_void_p()
        scale_type = _R_32F if out_type == _R_8I else _R_32I
        lt.check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32I, scale_type), "MatmulDescCreate")
        lt.set_attr(self.desc, _DESC_TRANSA, ctypes.c_int32(1))
        self.a, self.b = lt.layout(_R_8I, k, n, k), lt.layout(_R_8I, k, m, k)
        self.c = lt.layout(out_type, n, m, n)
        pref = ctypes.c_void_p()
        lt.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        lt.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ctypes.c_uint64(WORKSPACE_BYTES)), 8),
                 "MatmulPreferenceSetAttribute")
        found, count = _Heuristic(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, self.desc, self.a, self.b, self.c, self.c, pref, 1,
                                                    ctypes.byref(found), ctypes.byref(count))
        if status != 0 or count.value < 1:
            raise RuntimeError(f"no cuBLASLt int8 algorithm for {m}x{n}x{k} (status {status})")
        self.algo = found.algo
        one = np.ones((), np.float32 if scale_type == _R_32F else np.int32)
        self.one, self.zero = one, np.zeros((), one.dtype)

    def __call__(self, a, w, out, stream_ptr: int) -> None:
        from powerfusion.backends.cuda.blaslt import WORKSPACE_BYTES
        self.lt.check(self.lt.lib.cublasLtMatmul(
            self.lt.handle, self.desc, self.one.ctypes.data, w.data.ptr, self.a, a.data.ptr, self.b,
            self.zero.ctypes.data, out.data.ptr, self.c, out.data.ptr, self.c, ctypes.byref(self.algo),
            self.lt.workspace.data.ptr, WORKSPACE_BYTES, stream_ptr), "Matmul (int8)")


def gemms() -> list[dict]:
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    from powerfusion.backends.cuda.blaslt import BlasLt
    from powerfusion.backends.cuda.int8_gemm import Int8Gemm
    stream = cupy.cuda.get_current_stream()
    blas = Blas()
    blas.bind(stream)
    ours, lt = Int8Gemm(blas), BlasLt()
    rng = np.random.default_rng(0)
    rows = []
    for m in (128, 1024, 4096):
        for n, k in SHAPES_NK:
            a8 = cupy.asarray(rng.integers(-127, 128, (m, k)).astype(np.int8))
            w8 = cupy.asarray(rng.integers(-127, 128, (k, n)).astype(np.int8))
            wt8 = cupy.ascontiguousarray(w8.T)
            a16, w16 = a8.astype(cupy.float16), w8.astype(cupy.float16)
            out32, out8, out16 = (cupy.empty((m, n), t) for t in (cupy.int32, cupy.int8, cupy.float16))
            row = {"m": m, "n": n, "k": k, "fp16_us": _time(lambda: cupy.matmul(a16, w16, out=out16)) * 1e6}
            row["int8_cublas_us"] = _time(lambda: ours.gemm_into("g", a8, w8, out32, b_constant=True)) * 1e6
            row["route"] = ours.routes.pop("g")
            for label, out, kind in (("int8_lt_i32_us", out32, _R_32I), ("int8_lt_i8_us", out8, _R_8I)):
                try:
                    call = _LtInt8(lt, m, n, k, kind)
                    row[label] = _time(lambda: call(a8, wt8, out, stream.ptr)) * 1e6
                except Exception as e:      # noqa: BLE001  (record why, keep measuring)
                    row[label] = f"{type(e).__name__}: {e}"[:200]
            ours._weights.clear()
            rows.append(row)
            print(row, flush=True)
    return rows


def layer_profiles(layers: int, batch: int, seq: int, kinds: list[str]) -> list[dict]:
    import cupy
    from bench_models import graph_replay_times
    from bench_precision import _int8_gemms, _model_for, bert_base_like
    from kernel_profile import profile_calls, summarize
    from models.export import sample_inputs
    from powerfusion import InferenceSession
    recipe, model = bert_base_like(layers, batch, seq)
    feeds = sample_inputs(recipe.inputs, 0)
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        row = {"batch": batch, "seq": seq, "layers": layers, "impl": kind}
        try:
            m = _model_for(kind.split("+")[0], model, recipe)
            precision = kind if kind in ("fp16", "bf16") else kind.split("+")[1] if "+" in kind else "fp32"
            sess = InferenceSession(m, target="cuda", options={"cuda_graph": True, "precision": precision})
            sess.run(None, feeds)
            row["build_s"] = time.perf_counter() - t0
            row["device_us"] = statistics.median(graph_replay_times(sess)) * 1e6
            runner = sess._executor
            with cupy.cuda.Device(runner.device_id):
                recs = profile_calls(runner._replay, calls=1, synchronize=cupy.cuda.Device().synchronize)
            row["summary"] = summarize(recs, 1)
            row["kernels"] = [[r.name[:100], round(r.us, 2)] for r in recs]
            if kind.startswith("int8"):
                row["int8_gemms"] = _int8_gemms(sess)
        except Exception:
            row["error"] = traceback.format_exc(limit=4)[-1500:]
        print({k: v for k, v in row.items() if k not in ("kernels", "summary")}, flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--shapes", default="1x128,8x128", help="batch x seq, comma-separated")
    ap.add_argument("--kinds", default="fp16,int8-static,int8-gemms+fp16,int8-gemms")
    ap.add_argument("--large-kinds", default="fp16,int8-gemms+fp16", help="kinds at every shape after the first")
    ap.add_argument("--skip-gemms", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out) / "int8_profile.json"
    result: dict = {}

    def save():
        out.write_text(json.dumps(result, indent=1, default=str))
    if not args.skip_gemms:
        try:
            result["gemms"] = gemms()
        except Exception:
            result["gemms_error"] = traceback.format_exc(limit=4)
        save()
    result["layers"] = []
    for i, shape in enumerate(args.shapes.split(",")):
        batch, seq = (int(v) for v in shape.split("x"))
        kinds = (args.kinds if i == 0 else args.large_kinds).split(",")
        result["layers"] += layer_profiles(args.layers, batch, seq, kinds)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
