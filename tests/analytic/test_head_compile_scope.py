"""The step model compiles what the engine compiles (``analytic.memory.compile_scope``, the rule the memory estimate
reads). Where the blocks are compiled one by one (DDP's and FSDP2's default) the output head and the loss run
eager: the logits' element-wise traffic is charged at the eager factor (a 151,936-token vocabulary at T = 4,096
makes it 2.6% of a DDP step on one H200: plan-verify/1xh200-2026-11-28, Qwen2.5-1.5B's DDP layouts over-predicted
by 8-9% before, 5-6% after). DeepSpeed ZeRO-3 under ``engine.compile`` runs its gathering hooks eagerly and is
predicted as eager (measured on 4 H200s: 67.9k compiled against 66.7k eager tokens/s per GPU, mla-1b)."""
from __future__ import annotations

import pytest

from scaletool.analytic.calibration import shipped_calibration
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe
from scaletool.hf import load_recipe as load_hf

QWEN = "tests/hf_configs/qwen2.5-1.5b.json"


def test_a_per_block_compile_charges_the_logits_at_the_eager_factor():
    cal = shipped_calibration("h200")
    sets = ["train.seq_len=4096", "train.micro_batch_size=5", "train.compile=true", "parallel.engine=ddp"]
    block = predict_step(load_hf(QWEN, sets), cal, world_size=1)
    model = predict_step(load_hf(QWEN, [*sets, "train.compile_scope=model"]), cal, world_size=1)
    e = cal.elementwise
    logits = (e["eager_bytes_factor"] - e["compiled_bytes_factor"]) * 5 * 4096 * 4 * 151936 / (cal.hbm_gb_s * 1e9)
    assert block["terms"]["elementwise_s"] - model["terms"]["elementwise_s"] == pytest.approx(logits, rel=1e-9)
    assert block["step_s"] > model["step_s"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_compiled_is_whole_model_compiled_but_zero3_is_eager(stage):
    cal = shipped_calibration("h200")
    sets = ["parallel.engine=deepspeed", f"parallel.zero_stage={stage}", "train.micro_batch_size=8"]
    eager = predict_step(load_recipe("recipes/mla-1b.yaml", [*sets, "train.compile=false"]), cal, world_size=4)
    comp = predict_step(load_recipe("recipes/mla-1b.yaml", [*sets, "train.compile=true"]), cal, world_size=4)
    if stage == 3:
        assert comp["step_s"] == eager["step_s"] and comp["terms"] == eager["terms"]
    else:
        assert comp["step_s"] < eager["step_s"]
        assert comp["terms"]["elementwise_s"] < eager["terms"]["elementwise_s"]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_pipeline_stage_without_the_head_pays_nothing_for_the_vocabulary(compiled):
    """Stages compile each block alone, so the head's traffic is charged at the eager factor on the last rank and
    taken off every other rank at the same factor: the other ranks' compute does not move with the vocabulary."""
    cal = shipped_calibration("h200")

    def ranks(vocab):
        sets = ["parallel.engine=fsdp", "parallel.pipeline_parallel=2", "parallel.pipeline_microbatches=4",
                "train.micro_batch_size=4", f"train.compile={str(compiled).lower()}", f"model.vocab_size={vocab}"]
        from scaletool.predict.prediction import predict
        return predict(load_recipe("recipes/mla-1b.yaml", sets), cal, world_size=2)["ranks"]
    small, large = ranks(32000), ranks(36000)
    assert small[0]["layers"] == large[0]["layers"]  # the same split: a vocabulary this close does not move it
    assert small[0]["compute_s"] == pytest.approx(large[0]["compute_s"], rel=1e-12)
    assert large[-1]["compute_s"] > small[-1]["compute_s"]
