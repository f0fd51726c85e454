"""The GPU profile summary (``pipeline.bench.profiling``): kernel groups, device events only, the tables."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from pipeline.bench.profiling import (
    KernelTime,
    device_kernels,
    format_kernels,
    kernel_group,
    kernel_summary,
    kernel_table,
)

# Kernel names as the H200 profiles of 2026-11-27 printed them (docs/data/gpu/h200_2026-11-27_tome-kmeans-eager/,
# cut at 60 characters there), each with the group a reader of that profile puts it in.
H200_KERNELS = [
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "GEMM, bf16 / fp16"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f...", "attention (fused SDPA)"),
    ("_column_sums", "scores, eq. 4 (Triton)"),
    ("_row_lse", "scores, eq. 4 (Triton)"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x6...", "GEMM, float32 (TF32)"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x128x32_...", "GEMM, float32 (TF32)"),
    ("_cost_kernel", "K-Medoids iterations (Triton)"),
    ("_assign_kernel", "K-Medoids iterations (Triton)"),
    ("triton_poi_fused_gelu_view_10", "inductor: GELU"),
    ("triton_per_fused__to_copy_add_native_layer_norm_view_15", "inductor: LayerNorm, residual"),
    ("triton_poi_fused__to_copy_8", "inductor: other"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, ...", "top-k, sort"),
    ("void at::native::radixSortKVInPlace<2, -1, 32, 32, float,...", "top-k, sort"),
    ("void at::native::elementwise_kernel<128, 2, at::native::g...", "other aten kernels"),
    ("void at::native::(anonymous namespace)::multi_tensor_appl...", "other aten kernels"),
    ("Memset (Unknown)", "memcpy, memset"),
    ("Memcpy DtoD (Device -> Device)", "memcpy, memset"),
    ("some_kernel_nobody_named", "other"),
]


@pytest.mark.parametrize("name, group", H200_KERNELS)
def test_kernel_groups_of_the_h200_profile(name, group):
    assert kernel_group(name) == group


def _event(name: str, us: float, device: DeviceType = DeviceType.CUDA, annotation: bool = False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_device_kernels_count_each_kernel_once():
    # torch.profiler gives a record_function range (a CPU event, and a device-side annotation) and the CPU op
    # that launched a kernel that kernel's time as well: only the kernels themselves count.
    events = [
        _event("## Call CompiledFxGraph abc", 900.0, DeviceType.CPU),
        _event("## Call CompiledFxGraph abc", 880.0, annotation=True),
        _event("aten::mm", 300.0, DeviceType.CPU),
        _event("nvjet_sm90_tst_192x192", 300.0),
        _event("_column_sums", 41.0),
        _event("_column_sums", 39.0),
        _event("Memset (Unknown)", 1.0),
    ]
    kernels = {k.name: (k.us, k.calls) for k in device_kernels(events)}
    assert kernels == {"nvjet_sm90_tst_192x192": (300.0, 1), "_column_sums": (80.0, 2),
                       "Memset (Unknown)": (1.0, 1)}


def test_format_kernels_sums_groups_and_cuts_the_list():
    kernels = [KernelTime("nvjet_a", 600.0, 3), KernelTime("nvjet_b", 200.0, 1), KernelTime("_column_sums", 150.0, 10),
               KernelTime("triton_poi_fused_gelu_1", 40.0, 1), KernelTime("Memset (Unknown)", 10.0, 5)]
    text = format_kernels(kernels, rows=3)
    assert text.splitlines()[0] == "device time of one call: 1.000 ms in 20 kernels"
    assert "| GEMM, bf16 / fp16 | 0.800 | 80.0% | 4 |" in text
    assert "| scores, eq. 4 (Triton) | 0.150 | 15.0% | 10 |" in text
    assert text.index("GEMM, bf16") < text.index("| scores") < text.index("| inductor: GELU")  # largest first
    assert "| `nvjet_a` | GEMM, bf16 / fp16 | 0.600 | 3 | 200.0 |" in text
    assert "`triton_poi_fused_gelu_1`" not in text  # beyond the 3 rows ...
    assert "| 2 more | | 0.050 | 6 | |" in text  # ... and counted


def test_kernel_table_on_the_cpu_is_torch_profilers_table():
    import torch

    x = torch.randn(64, 64)
    text = kernel_table(lambda: x @ x)
    assert "aten::mm" in text and "Self CPU" in text


def test_a_failing_kernel_summary_is_one_line_not_an_exception():
    # The summary is logged after a model's timings: a profiler whose events differ (another torch) must not
    # take the run down with it.
    def events():
        raise AttributeError("'FunctionEvent' object has no attribute 'time_range'")

    assert kernel_summary(SimpleNamespace(events=events)) == (
        "(no kernel summary: AttributeError: 'FunctionEvent' object has no attribute 'time_range')")
    ok = SimpleNamespace(events=lambda: [_event("_column_sums", 40.0)])
    assert kernel_summary(ok).startswith("device time of one call: 0.040 ms in 1 kernels")
