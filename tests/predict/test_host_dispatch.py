"""The eager host issue time (scaletool.analytic.host): measured per block on a real model, and a step whose
device work is shorter than the host's issue time is predicted at the host's pace, in predict_step and per
pipeline stage; compiled blocks and tensor parallelism (its own fitted dispatch) are not charged."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from scaletool.analytic.calibration import shipped_calibration
from scaletool.analytic.host import block_dispatch_s, eager_dispatch_s, overhead_key
from scaletool.analytic.pipeline_time import pipeline_step
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe
from scaletool.predict.calibrate_host import measure_block_dispatch, overheads_from, probe, probe_bytes


def _calib(**ov):
    """The shipped H100 calibration with only the eager issue times given here (its measured ones left out)."""
    base = shipped_calibration("h100-sxm")
    kept = {k: v for k, v in base.overheads.items() if not k.startswith("eager_")}
    return dataclasses.replace(base, overheads={**kept, **ov})


def test_probe_times_both_engine_modes_at_both_block_counts():
    recipe = load_recipe("tiny", [])
    res = probe(recipe.model, recipe.seq_len, torch.device("cpu"), ("autocast", "bf16"))
    assert res["tokens"] == min(recipe.seq_len, 128) and res["blocks"] == [1, 3]
    for mode in ("autocast", "bf16"):
        s = res[mode]["block_s"]
        assert s["p10"] <= s["median"] <= s["p90"] and s["n"] == 9
        assert all(len(res[mode]["iteration_s"][k]) == 9 for k in ("1", "3"))
    m = {"autocast": {"block_s": 0.002, "key": overhead_key("autocast", "mla", False)},
         "bf16": {"block_s": -1e-5, "key": overhead_key("bf16", "mla", False)}}  # noise below zero: none measurable
    assert overheads_from(m) == {"eager_autocast_block_mla_s": 0.002, "eager_bf16_block_mla_s": 0.0}


def test_keys_fall_back_from_the_attention_and_moe_figure_to_the_dense_mha_one():
    cal = _calib(eager_autocast_block_s=0.004, eager_autocast_block_moe_s=0.009, eager_bf16_block_mla_s=0.006)
    assert block_dispatch_s("gqa", False, True, cal) == 0.004
    assert block_dispatch_s("mla", True, True, cal) == 0.009        # no MLA+MoE figure: MHA's MoE one
    assert block_dispatch_s("mla", False, False, cal) == 0.006
    assert block_dispatch_s("mha", False, False, cal) == 0.0        # nothing measured for that mode
    with pytest.raises(ValueError, match="mode"):
        overhead_key("graphs", "mha", False)
    moe = load_recipe("deepseek-v2-lite").model
    assert moe.first_k_dense_replace == 1
    # the leading dense layer at the dense figure, the rest at the MoE one, per micro-batch
    got = eager_dispatch_s(moe, range(3), 2, True, False, cal)
    assert got == pytest.approx(2 * (0.004 + 2 * 0.009))
    assert eager_dispatch_s(moe, range(3), 2, True, True, cal) == 0.0


def test_a_small_eager_step_is_host_bound_and_a_large_one_is_not():
    small = load_recipe("mla-1b", ["parallel.engine=single", "train.micro_batch_size=1", "train.seq_len=256",
                                   "train.compile=false"])
    without = predict_step(small, _calib())
    cal = _calib(eager_autocast_block_mla_s=0.005)
    with_host = predict_step(small, cal)
    L = small.model.n_layers
    assert with_host["terms"]["eager_dispatch_s"] == pytest.approx(L * 0.005)
    assert with_host["step_s"] == pytest.approx(L * 0.005 + with_host["terms"]["host_overhead_s"])
    assert with_host["step_s"] > without["step_s"] and with_host["bound"] == "host dispatch (eager)"
    assert any("host issue time" in a for a in with_host["assumptions"])
    # compiled: no eager issue time; device-bound large micro-batch: unchanged
    compiled = load_recipe("mla-1b", ["parallel.engine=single", "train.micro_batch_size=1", "train.seq_len=256",
                                      "train.compile=true"])
    assert predict_step(compiled, cal)["step_s"] == pytest.approx(predict_step(compiled, _calib())["step_s"])
    big = load_recipe("mla-1b", ["parallel.engine=single", "train.micro_batch_size=8", "train.compile=false"])
    assert predict_step(big, cal)["step_s"] == pytest.approx(predict_step(big, _calib())["step_s"])
    # FSDP2 computes on bf16 weights: the bf16 figure, not the autocast one
    fsdp = load_recipe("mla-1b", ["parallel.engine=fsdp", "train.micro_batch_size=1", "train.seq_len=256",
                                  "train.compile=false"])
    assert predict_step(fsdp, cal, world_size=2)["terms"]["eager_dispatch_s"] == 0.0
    assert predict_step(fsdp, _calib(eager_bf16_block_mla_s=0.005), world_size=2)["terms"]["eager_dispatch_s"] > 0


def test_a_pipeline_stage_slot_is_at_least_its_issue_time():
    r = load_recipe("mla-1b", ["parallel.engine=fsdp", "parallel.pipeline_parallel=4", "train.micro_batch_size=4",
                               "parallel.pipeline_microbatches=4", "train.compile=false"])
    base = pipeline_step(r, _calib(), world_size=4)
    slow = pipeline_step(r, _calib(eager_bf16_block_mla_s=0.02), world_size=4)
    assert slow["step_s"] > base["step_s"]
    # the bounding rank's 4 micro-batches of its blocks at 20 ms each; the bubble stays at the devices' pace (the
    # host issues on through the fill and drain: PP 2 x TP 2 on 4 H200s, docs/prediction.md)
    assert slow["terms"]["pipeline/busy_s"] >= 4 * 4 * 0.02
    assert slow["terms"]["pipeline/bubble_s"] == pytest.approx(base["terms"]["pipeline/bubble_s"])
    assert all(x["micro_batch_s"] > x["device_micro_batch_s"] for x in slow["ranks"])


def test_a_model_whose_blocks_do_not_fit_is_not_probed_and_says_why():
    big = load_recipe("deepseek-v3")
    # three of DeepSeek-V3's MoE blocks with the embedding and the head: about 36 B parameters
    assert probe_bytes(big.model) > 300e9
    res = measure_block_dispatch(big, torch.device("cpu"))
    assert res["skipped"].startswith("not measured: 3 blocks of this model hold") and "autocast" not in res
    assert overheads_from(res) == {}
    # a regression model reads features, not tokens: not probed either, and said so
    res = measure_block_dispatch(load_recipe("price-transformer"), torch.device("cpu"))
    assert "language models" in res["skipped"] and overheads_from(res) == {}


def test_calibrate_says_the_issue_time_it_measured(tmp_path):
    from conftest import run_cli

    out = tmp_path / "cal.yaml"
    res = run_cli("calibrate", "--device", "cpu", "--recipe", "tiny", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("eager block issue time"))
    assert "(1 process(es) at once): autocast" in line and line.endswith("ms per block")
