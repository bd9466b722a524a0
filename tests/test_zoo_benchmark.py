"""The model-zoo benchmark's device-free parts: kernel categories (names seen in real profiles
of torch eager, torch.compile and PowerFusion on the H200), per-call summaries with gaps, and
the geomean over rows where both sides were measured."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_zoo import geomeans  # noqa: E402
from kernel_profile import KernelRecord, categorize, summarize  # noqa: E402


@pytest.mark.parametrize("name,category", [
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3", "library"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nn_align1>", "library"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float>", "library"),
    ("conv2d_c1_k1_nhwc", "library"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "library"),
    ("triton_tem_fused_addmm_0", "library"),
    ("pf_im2col_w32", "library"),
    ("triton_poi_fused_convolution_native_layer_norm_permute_15", "memory-bound"),
    ("sg12_k3", "memory-bound"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>", "memory-bound"),
    ("void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false>", "copies"),
    ("Memset (Unknown)", "copies"),
])
def test_categories(name, category):
    assert categorize(name) == category


def test_summary_per_call_with_gaps():
    # two calls; each: a GEMM 0-10 us, a fused kernel 12-15 us overlapping nothing, a copy 15-16 us
    recs = [KernelRecord(n, t + a, t + b) for t in (0.0, 100.0)
            for n, a, b in (("sm80_xmma_gemm_x", 0, 10), ("sg0_k0", 12, 15), ("Memcpy DtoD", 15, 16))]
    s = summarize(recs, calls=2)
    cats = s["categories"]
    assert (cats["library"]["us"], cats["memory-bound"]["us"], cats["copies"]["us"]) == (10, 3, 1)
    assert cats["library"]["kernels"] == 1
    assert s["span_us"] == pytest.approx(116 / 2)
    assert cats["gaps"]["us"] == pytest.approx((116 - 28) / 2)   # 2 us inside each call, 84 between


def test_geomean_over_rows_with_both_sides():
    rows = [{"case": "a", "batch": 1, "dtype": "fp32", "impl": "powerfusion", "device_time_s": 1.0},
            {"case": "a", "batch": 1, "dtype": "fp32", "impl": "torch-compile", "device_time_s": 2.0},
            {"case": "b", "batch": 1, "dtype": "fp32", "impl": "powerfusion", "device_time_s": 4.0},
            {"case": "b", "batch": 1, "dtype": "fp32", "impl": "torch-compile", "device_time_s": 2.0},
            {"case": "c", "batch": 1, "dtype": "fp32", "impl": "powerfusion", "error": "build: ..."},
            {"case": "c", "batch": 1, "dtype": "fp32", "impl": "torch-compile", "device_time_s": 2.0}]
    g = geomeans(rows)["fp32 torch-compile / powerfusion"]
    assert g["geomean"] == pytest.approx(1.0) and g["rows"] == 2 and g["min"] == pytest.approx(0.5)
