"""The step-time model against every committed GPU training run: a change to the model or to the shipped
calibrations that worsens the error distribution past the tolerances docs/prediction.md states fails here.

Fitted on the H100 SXM single-GPU runs; the H200 runs and every 2- and 4-GPU run are held out."""
from __future__ import annotations

import pytest

from scaletool.predict.claims import HOST_BOUND_S
from scaletool.predict.validation import summarize, validate

# docs/prediction.md: achieved, rounded up a little
TOLERANCE = {  # (median |error|, worst |error|)
    # every committed dense bf16 run, H100 and H200 (297 runs: 2.7%, 39.4%: TP 2 eager over FSDP2's one-rank mesh
    # on a host whose DTensor dispatch ran 1.6x faster than the host its per-block figures were fitted on)
    "dense": (0.04, 0.41),
    "dense but ZeRO-3": (0.04, 0.41),  # 277 runs: 2.6%, 39.4%, the same TP 2 run
    "ZeRO-3": (0.07, 0.39),  # DeepSpeed ZeRO-3, its defaults and scaletool's (17 runs: 6.7%, 37.7%)
    "H100": (0.035, 0.19),   # the card the model was fitted on (76 runs: 2.7%, 13.9%)
    # compiled single, FSDP2 and TP (183 runs: 2.3%, 23.4%: Phi-3-mini's FSDP2 at mb 12, out of sample, run at the
    # allocator's limit, reserved 138.0 of 139.8 GiB; then TP=2 over FSDP2's one-rank mesh, host-bound, 20.1%)
    "compiled": (0.055, 0.24),
    # tensor parallelism, eager and compiled, 1B and Llama-3-8B layers (15 runs: 7.7%, 39.4%: the two runs of
    # pipeline/4xh200-2026-11-28-tp-host, the layout the figures were fitted on, on another host)
    "TP": (0.08, 0.41),
    "MoE dropless": (0.05, 0.11),  # 16 experts top-2, grouped GEMMs, compiled, one H100 (15 runs: 4.4%, 9.9%)
}



@pytest.fixture(scope="module")
def runs() -> list[dict]:
    out = validate()
    assert not out["skipped"] and not out["duplicates"], (out["skipped"], out["duplicates"])
    return out["runs"]


def _check(rows, key):
    s = summarize(rows)["all"]
    median, worst = TOLERANCE[key]
    assert s["median_abs_error"] <= median and s["worst_abs_error"] <= worst, (key, s)
    return s


def test_the_runs_outside_the_model_are_those_its_failure_list_names(runs):
    """Each run the model does not claim carries its reason, and the summary's ``modelled`` is the rest."""
    reasons = {r["outside"] for r in runs}
    assert reasons == {None, "host", "float8", "capacity", "async_tp", "tp_local_ops", "pipeline_tp", "allocator"}
    out = validate()["summary"]
    assert out["modelled"]["n"] == sum(1 for r in runs if r["outside"] is None)
    assert sum(s["n"] for s in out["outside"].values()) == sum(1 for r in runs if r["outside"])


def test_every_committed_gpu_run_is_predicted(runs):
    assert len(runs) >= 80
    cards = {r["calibration"] for r in runs}
    assert cards == {"H100 SXM", "H200"}
    assert {r["world_size"] for r in runs} == {1, 2, 4}
    assert {"ddp", "fsdp", "single", "deepspeed ZeRO-1", "deepspeed ZeRO-2", "deepspeed ZeRO-3"} <= {r["engine"] for r in runs}


def _host_bound(r) -> bool:
    return r["predicted_step_s"] < HOST_BOUND_S


def test_error_distribution_within_the_stated_tolerance(runs):
    dense = [r for r in runs if not r["moe"] and not r["async_tp"] and r["float8"] == "none" and not r["tp_local_ops"]
             and not r["pipeline_tp"] and not r["alloc_retries"]
             and not _host_bound(r)]
    _check(dense, "dense")
    _check([r for r in dense if "ZeRO-3" not in r["engine"]], "dense but ZeRO-3")
    _check([r for r in dense if "ZeRO-3" in r["engine"]], "ZeRO-3")
    _check([r for r in dense if "TP" in r["engine"]], "TP")
    _check([r for r in dense if "H100" in r["card"]], "H100")
    _check([r for r in dense if r["compiled"]], "compiled")


def test_dropless_moe_is_predicted_and_the_capacity_dispatch_stays_a_visible_failure(runs):
    """Dropless MoE (tokens sorted by expert, grouped GEMMs) is predicted within the MoE tolerance. The
    capacity dispatch (a fixed [E, C, d] buffer: the first MoE run and the expert-parallel pair) runs at about
    half the predicted rate: its gathers and scatters are not modelled. Should the model learn them, this test
    says so and docs/prediction.md's failure list needs updating."""
    dropless = [r for r in runs if r["moe"] and r["moe_dispatch"] == "dropless"]
    assert len(dropless) >= 10
    _check(dropless, "MoE dropless")
    capacity = [r for r in runs if r["moe"] and r["moe_dispatch"] == "capacity"]
    assert len(capacity) == 3 and all(r["rel_error"] > 0.5 for r in capacity), [(r["run"], r["rel_error"]) for r in capacity]


def test_tiny_host_bound_runs_stay_visible(runs):
    """The two loss-curve runs (an 8-layer, 512-wide model, eager, steps of 25 ms and more) are predicted at
    7 ms of device work: their steps are the host's. With the eager block issue time measured on an H100 host
    (2026-11-28) the bf16 run is predicted within 50% (it was +254% without); the FP8 run's swapped layers issue
    more ops than the bf16 block the probe times, so it stays far off. Both kept out of the tolerances."""
    tiny = {r["run"].rsplit("/", 1)[-1]: r["rel_error"] for r in runs if _host_bound(r)}
    assert set(tiny) == {"loss-none.json", "loss-tensorwise.json"}, tiny
    assert abs(tiny["loss-none.json"]) < 0.5 and tiny["loss-tensorwise.json"] > 1.0, tiny


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
    fp8 = [r for r in runs if r["float8"] != "none" and not _host_bound(r)]
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


def test_tensor_parallelism_inside_pipeline_stages_stays_a_visible_failure(runs):
    """PP 2 x TP 2 on three 4-H200 hosts (mla-1b, 4 sequences a micro-batch, eager and compiled): host-bound, each
    micro-batch's slot set by the H200 calibration's TP block issue time, measured on the third host; there they are
    predicted 3-7% too slow (13-19% while fill and drain were charged as host-bound slots, not at the devices'
    pace), on the other two 2-36%. Kept out of the claims; a change that closes the gap shows here."""
    staged = {r["run"]: r["rel_error"] for r in runs if r["outside"] == "pipeline_tp"}
    assert len(staged) == 12 and all(-0.4 < e < -0.02 for e in staged.values()), staged
    probed = [e for run, e in staged.items() if "tp-probe" in run]
    assert len(probed) == 4 and all(-0.08 < e < -0.03 for e in probed), probed


def test_position_encodings_as_the_model_charges_them(runs):
    """MPT-1B's shape on one H200 (benchmarks/results/published-shape/h200-2026-11-28-mpt): without a position
    encoding predicted within 2%; RoPE (inside the fitted element-wise factor for Llama's shapes) +15%, a visible
    gap; ALiBi's dense-bias SDPA at the bias path's rate that attention_seq.py measured apart (no run fitted it):
    +20% when it was charged the causal kernel's, within 3% now."""
    mpt = {r["run"].split("/")[-2]: r for r in runs if "h200-2026-11-28-mpt/" in r["run"]}
    assert mpt["mp1-alibi"]["outside"] is None and abs(mpt["mp1-alibi"]["rel_error"]) < 0.03
    assert mpt["mp1-rope"]["outside"] is None and 0.1 < mpt["mp1-rope"]["rel_error"] < 0.2
    assert abs(mpt["mp1-none"]["rel_error"]) < 0.02
