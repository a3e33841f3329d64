"""A decode point's floors and bound: the largest floor names it, an unknown floor never does."""
from __future__ import annotations

import pytest
import torch
from tiny_variants import tiny_model

from scaletool.decode.bounds import (
    Floors,
    copy_bandwidth,
    graph_kernel_seconds,
    kernel_breakdown,
    kernel_group,
    point_bound,
    step_kernels,
)
from scaletool.decode.steps import EagerSteps
from scaletool.model.attention import DecodeMode
from scaletool.model.cache import make_caches

GPU = Floors(copy_bandwidth_bytes_per_s=3e12, graph_kernel_s=2e-6, peak_flops=1e15, peak_flops_source="test")


@pytest.mark.parametrize("nbytes,flops,kernels,bound", [
    (3e9, 1e9, 400, "memory"),  # 1 ms of bytes, 1 µs of FLOPs, 0.8 ms of launches
    (3e6, 1e9, 400, "launch"),  # batch 1 of a small model: 1 µs of bytes against 0.8 ms of kernels
    (3e9, 5e12, 400, "compute"),  # 5 ms of FLOPs
])
def test_the_bound_is_the_largest_floor(nbytes, flops, kernels, bound):
    out = point_bound(GPU, 2e-3, nbytes, flops, kernels)
    assert out["decode_bound"] == bound
    floor = out[f"decode_floor_{bound}_s"]
    assert floor == max(v for k, v in out.items() if k.startswith("decode_floor_"))
    assert out["decode_step_over_floor"] == pytest.approx(2e-3 / floor)
    assert out["decode_hbm_fraction_of_copy"] == pytest.approx(nbytes / 2e-3 / 3e12)


def test_unknown_floors_are_left_out_of_the_bound():
    cpu = Floors(copy_bandwidth_bytes_per_s=5e10, graph_kernel_s=None, peak_flops=None, peak_flops_source="none")
    out = point_bound(cpu, 1e-3, 1e6, 1e15, 500)
    assert out["decode_floor_compute_s"] is None and out["decode_floor_launch_s"] is None
    assert out["decode_bound"] == "memory"
    nothing = Floors(None, None, None, "none")
    assert point_bound(nothing, 1e-3, 1e6, 1e9, None)["decode_bound"] is None


def test_cpu_measures_a_copy_and_counts_no_kernels():
    assert copy_bandwidth(torch.device("cpu"), nbytes=2**20, reps=3) > 0
    assert graph_kernel_seconds(torch.device("cpu")) is None
    cfg, model, mla = tiny_model("mla")
    caches = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu", mla_mode=mla)
    st = EagerSteps(model, caches, DecodeMode(mla, "torch"), torch.zeros(1, dtype=torch.long), 2)
    assert step_kernels(st) is None and st.pos == 2


def test_kernel_names_fall_into_groups():
    assert kernel_group("_latent_decode_kernel") == kernel_group("_merge_kernel") == "attention"
    assert kernel_group("_merge_up_kernel") == "attention"  # the split merge that applies W_UV
    assert kernel_group("_absorb_q_kernel") == "attention"  # the query through W_UK
    assert kernel_group("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kernel_group("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT") == "matmul"
    assert kernel_group("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "matmul"
    assert kernel_group("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused element-wise (inductor)"
    assert kernel_group("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_breakdown_sums_groups_and_ranks_kernels_by_total_time():
    found = [("gemv2T_kernel", 3e-6), ("triton_poi_fused_add_0", 1e-6), ("gemv2T_kernel", 4e-6),
             ("_mla_decode_kernel", 5e-6), ("Memcpy DtoD", 0.5e-6)]
    out = kernel_breakdown(found, top=2)
    assert out["busy_s"] == pytest.approx(13.5e-6)
    assert out["groups_s"] == pytest.approx({"matmul": 7e-6, "attention": 5e-6,
                                             "fused element-wise (inductor)": 1e-6, "copy": 0.5e-6})
    assert list(out["groups_s"]) == ["matmul", "attention", "fused element-wise (inductor)", "copy"]
    assert out["top"] == [{"name": "gemv2T_kernel", "calls": 2, "s": pytest.approx(7e-6)},
                          {"name": "_mla_decode_kernel", "calls": 1, "s": 5e-6}]
