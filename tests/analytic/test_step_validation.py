"""The step-time model against every committed GPU training run: a change to the model or to the shipped
calibrations that worsens the error distribution past the tolerances docs/prediction.md states fails here.

Fitted on the H100 SXM single-GPU runs; the H200 runs and every 2- and 4-GPU run are held out."""
from __future__ import annotations

import pytest

from scaletool.measure.validation import summarize, validate

# docs/prediction.md: achieved, rounded up a little
TOLERANCE = {  # (median |error|, worst |error|)
    "dense": (0.04, 0.39),  # every committed dense bf16 run, H100 and H200 (115 runs: 3.9%, 37.7%)
    "dense but ZeRO-3": (0.04, 0.26),  # the same without ZeRO-3 (98 runs: 3.8%, 24.5%)
    "ZeRO-3": (0.07, 0.39),  # DeepSpeed ZeRO-3, its defaults and scaletool's (17 runs: 6.7%, 37.7%)
    "H100": (0.035, 0.19),   # the card the model was fitted on (60 runs: 2.6%, 17.7%)
    # compiled single, FSDP2 and TP (36 runs: 5.0%, 20.5%: TP=2 with FSDP2 over one rank, host-bound, whose rate
    # varies by +-20% from call to call on the same machine; Llama-3-8B's layers at 4 and 8 layers over-predicted
    # by 6.5-15.7%, most at 4 layers)
    "compiled": (0.055, 0.21),
    "TP": (0.06, 0.21),  # tensor parallelism, eager and compiled, 1B and Llama-3-8B layers (11 runs: 5.9%, 20.5%)
}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    out = validate()
    assert not out["skipped"]
    return out["runs"]


def _check(rows, key):
    s = summarize(rows)["all"]
    median, worst = TOLERANCE[key]
    assert s["median_abs_error"] <= median and s["worst_abs_error"] <= worst, (key, s)
    return s


def test_every_committed_gpu_run_is_predicted(runs):
    assert len(runs) >= 80
    cards = {r["calibration"] for r in runs}
    assert cards == {"H100 SXM", "H200"}
    assert {r["world_size"] for r in runs} == {1, 2, 4}
    assert {"ddp", "fsdp", "single", "deepspeed ZeRO-1", "deepspeed ZeRO-2", "deepspeed ZeRO-3"} <= {r["engine"] for r in runs}


def test_error_distribution_within_the_stated_tolerance(runs):
    dense = [r for r in runs if not r["moe"] and not r["async_tp"] and r["float8"] == "none" and not r["tp_local_ops"]]
    _check(dense, "dense")
    _check([r for r in dense if "ZeRO-3" not in r["engine"]], "dense but ZeRO-3")
    _check([r for r in dense if "ZeRO-3" in r["engine"]], "ZeRO-3")
    _check([r for r in dense if "TP" in r["engine"]], "TP")
    _check([r for r in dense if "H100" in r["card"]], "H100")
    _check([r for r in dense if r["compiled"]], "compiled")


def test_the_known_failure_stays_visible(runs):
    """The one MoE run (16 experts, top-2, dropless) runs at less than half the predicted rate: its
    dispatch (routing, gathers, one small GEMM per expert) is not modelled. Should the model learn it,
    this test says so and docs/prediction.md's failure list needs updating."""
    (moe,) = [r for r in runs if r["moe"]]
    assert moe["rel_error"] > 0.5


def test_async_tensor_parallelism_is_not_modelled_and_says_so(runs):
    """Async TP (fused all-gather-matmul and matmul-reduce-scatter) ran slower than plain compiled TP on
    2 H200s; the model predicts it as plain TP, so it is over-predicted, and it is kept out of the
    tolerances as MoE is."""
    asyncs = [r for r in runs if r["async_tp"]]
    assert len(asyncs) == 2 and all(r["rel_error"] > 0.1 for r in asyncs)


def test_fp8_runs_are_over_predicted_while_the_fp8_gemm_rate_is_not_calibrated(runs):
    """FP8 runs are predicted with the swapped GEMMs at twice the bf16 curve (no calibration has an FP8
    rate yet): on one H100 tensorwise gained 1.11x at Llama-3-8B layer shapes, not the ~1.3x predicted, so
    they are over-predicted and kept out of the tolerances. A calibrated FP8 rate should bring them in."""
    fp8 = [r for r in runs if r["float8"] != "none"]
    assert len(fp8) == 7 and all(0.03 < r["rel_error"] < 0.25 for r in fp8), [(r["run"], r["rel_error"]) for r in fp8]


def test_tp_local_ops_is_not_modelled_and_says_so(runs):
    """parallel.tp_local_ops (each block's ops on local tensors) is predicted with the DTensor plan's host
    dispatch: compiled, where the step is the device's, that holds (within 5% on 2 H200s); eager, where the
    dispatch sets the step, the local plan runs faster than predicted. Kept out of the tolerances."""
    local = {r["compiled"]: [] for r in runs if r["tp_local_ops"]}
    for r in runs:
        if r["tp_local_ops"]:
            local[r["compiled"]].append(r["rel_error"])
    assert len(local[True]) == 2 and all(abs(e) < 0.05 for e in local[True]), local
    assert len(local[False]) == 2 and all(e < -0.15 for e in local[False]), local
