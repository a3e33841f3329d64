"""A decode point's floors and bound: the largest floor names it, an unknown floor never does."""
from __future__ import annotations

import pytest
import torch
from tiny_variants import tiny_model

from scaletool.decode.bounds import Floors, copy_bandwidth, graph_kernel_seconds, kernels_per_step, point_bound
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
    assert kernels_per_step(st) is None and st.pos == 2
