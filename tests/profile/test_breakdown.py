"""The breakdown on hand-built traces shaped like Kineto's output, where every share is known exactly."""
from __future__ import annotations

import gzip
import json

import pytest

from scaletool.profile.breakdown import ALL_CATEGORIES, ALL_MODULES, analyze, load_trace


def X(name, ts, end, cat="cpu_op", tid=1, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": end - ts, "args": args}


def launch(ts, corr):
    return X("cudaLaunchKernel", ts, ts + 2, cat="cuda_runtime", correlation=corr)


def kernel(name, ts, end, corr, stream=7):
    return X(name, ts, end, cat="kernel", pid=0, tid=stream, correlation=corr, stream=stream)


def _us(b: dict, key: str) -> dict:
    return {k: round(v["time_s"] * 1e6, 6) for k, v in b[key].items()}


GPU_TRACE = {"traceEvents": [
    # step 5 on the host
    X("ProfilerStep#5", 0, 1000, cat="user_annotation"),
    X("scaletool::ffn", 10, 100, cat="user_annotation"),
    X("aten::mm", 20, 40), launch(25, 101),
    X("scaletool::attention", 100, 200, cat="user_annotation"),
    X("aten::linear", 110, 130), X("aten::mm", 111, 129), launch(115, 102),
    X("aten::scaled_dot_product_attention", 140, 180), X("aten::_scaled_dot_product_flash_attention", 141, 179),
    launch(150, 103),
    X("c10d::allreduce_", 250, 260), launch(252, 105),
    X("Optimizer.step#AdamW.step", 300, 400, cat="user_annotation"), X("aten::_fused_adamw_", 310, 390),
    launch(320, 104),
    X("scaletool::unmeasured", 500, 600, cat="user_annotation"), X("aten::mm", 510, 520), launch(512, 106),
    # step 6
    X("ProfilerStep#6", 1000, 2000, cat="user_annotation"),
    X("aten::mm", 1010, 1020), launch(1012, 107),
    # the GPU
    kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 100, 200, 101),
    kernel("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", 200, 250, 102),
    kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 250, 350, 103),
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 300, 450, 105, stream=13),
    kernel("gemm_unmeasured", 380, 400, 106),
    kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 420, 470, 104),
    kernel("sm90_xmma_gemm_f32f32_f32f32_f32_nn_n", 600, 650, 107),
]}


def test_gpu_kernels_classified_by_name_and_launching_op():
    b = analyze(GPU_TRACE)
    assert b["device"] == "cuda" and b["steps"] == [5, 6]
    # step 5: window [100, 470] minus the unmeasured kernel's 20 µs; step 6: [470, 650]
    assert [round(t * 1e6, 6) for t in b["step_times_s"]] == [350, 180]
    assert _us(b, "categories") == {"ffn_matmul": 50, "other_matmul": 50, "attention": 50, "communication": 25,
                                    "optimizer": 25, "norm": 0, "other": 0, "idle": 65}
    assert _us(b, "modules") == {"ffn": 50, "attention": 75, "optimizer": 25, "communication": 25, "other": 25,
                                 "norm": 0, "idle": 65}
    c = b["communication_overlap"]  # per step: 130 µs of NCCL in step 5, 80 of it under compute
    assert round(c["communication_s"] * 1e6, 6) == 65 and round(c["overlapped_s"] * 1e6, 6) == 40
    assert c["overlap_ratio"] == pytest.approx(80 / 130)
    assert sum(v["share"] for v in b["categories"].values()) == pytest.approx(1.0)
    assert b["ffn_matmul_fraction_of_matmul"] == pytest.approx(0.5)
    names = {o["name"] for o in b["top_ops"]}
    assert "gemm_unmeasured" not in names and b["top_ops"][0]["category"] == "communication"


def flow(ph, ts, ident, tid=1):
    return {"ph": ph, "cat": "fwdbwd", "name": "fwdbwd", "id": ident, "pid": 1, "tid": tid, "ts": ts}


CPU_TRACE = {"traceEvents": [
    X("ProfilerStep#0", 0, 1000, cat="user_annotation"),
    X("scaletool::ffn", 0, 200, cat="user_annotation"),
    X("aten::linear", 10, 110), X("aten::mm", 20, 100), flow("s", 20, 1),
    X("aten::mul", 200, 250),
    X("aten::scaled_dot_product_attention", 250, 300), X("aten::bmm", 260, 290),
    X("aten::_softmax", 291, 299), flow("s", 291, 2),
    # backward of the FFN matmul, on the autograd thread, linked to its forward op by flow 1
    X("autograd::engine::evaluate_function: MmBackward0", 300, 500, tid=3), X("MmBackward0", 305, 495, tid=3),
    flow("f", 305, 1, tid=3), X("aten::mm", 310, 400, tid=3), X("aten::mm", 400, 490, tid=3),
    X("c10d::allreduce_", 500, 510),
    X("gloo:all_reduce", 505, 650, cat="user_annotation", tid=2),
    # backward of SDPA's softmax (math path): attention, although its name says nothing of it
    X("autograd::engine::evaluate_function: SoftmaxBackward0", 520, 560, tid=3),
    X("SoftmaxBackward0", 521, 559, tid=3), flow("f", 521, 2, tid=3),
    X("aten::_softmax_backward_data", 522, 558, tid=3),
    X("Optimizer.step#AdamW.step", 600, 800, cat="user_annotation"),
    X("aten::_foreach_add_", 610, 700),
    X("aten::rms_norm", 800, 850), X("aten::mul", 810, 840),
    X("scaletool::unmeasured", 850, 950, cat="user_annotation"), X("aten::mm", 860, 940),
    flow("s", 5, 3), flow("f", 2000, 3),  # a flow leaving the window links nothing
]}


def test_cpu_self_times_regions_and_gloo_threads(tmp_path):
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(CPU_TRACE).encode()))
    b = analyze(load_trace(path))
    assert b["device"] == "cpu" and b["step_times_s"] == [pytest.approx(900e-6)]
    assert _us(b, "categories") == {"ffn_matmul": 300, "other": 50, "attention": 90, "norm": 50, "optimizer": 90,
                                    "communication": 70, "other_matmul": 0, "idle": 250}
    # outside the annotated modules, SDPA and rms_norm ops are module "other" (but category attention/norm)
    assert _us(b, "modules") == {"ffn": 300, "other": 190, "optimizer": 90, "communication": 70,
                                 "attention": 0, "norm": 0, "idle": 250}
    c = b["communication_overlap"]  # gloo on its own thread, under the softmax backward and the optimizer
    assert round(c["communication_s"] * 1e6, 6) == 150 and round(c["overlapped_s"] * 1e6, 6) == 80
    assert set(b["categories"]) == set(ALL_CATEGORIES) and set(b["modules"]) == set(ALL_MODULES)


def test_trace_without_profiler_steps_is_a_clear_error():
    with pytest.raises(ValueError, match="ProfilerStep"):
        analyze({"traceEvents": [X("aten::mm", 0, 10)]})
