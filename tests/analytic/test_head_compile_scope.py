"""Where the blocks are compiled one by one (DDP's, FSDP2's and the pipeline stages' default), the output head
and the loss run eager: the step model charges the logits' element-wise traffic at the eager factor there, and
at the compiled one where the whole model is compiled (single's default, DeepSpeed's engine.compile,
train.compile_scope=model). A 151,936-token vocabulary at T = 4,096 makes it 2.6% of a DDP step on one H200
(plan-verify/1xh200-2026-11-28: Qwen2.5-1.5B's DDP layouts over-predicted by 8-9% before, 5-6% after)."""
from __future__ import annotations

import pytest

from scaletool.analytic.calibration import shipped_calibration
from scaletool.analytic.step import head_compiled, predict_step
from scaletool.hf import load_recipe
from scaletool.kinds.engines import engine_kind

QWEN = "tests/hf_configs/qwen2.5-1.5b.json"


@pytest.mark.parametrize("engine, scope, expected", [
    ("single", "auto", True), ("single", "block", False), ("ddp", "auto", False), ("ddp", "model", True),
    ("fsdp", "auto", False), ("deepspeed", "auto", True), ("deepspeed", "block", True)])
def test_which_engines_compile_the_head(engine, scope, expected):
    assert head_compiled(engine_kind(engine), True, scope) is expected
    assert head_compiled(engine_kind(engine), False, scope) is False


def test_a_per_block_compile_charges_the_logits_at_the_eager_factor():
    cal = shipped_calibration("h200")
    sets = ["train.seq_len=4096", "train.micro_batch_size=5", "train.compile=true", "parallel.engine=ddp"]
    block = predict_step(load_recipe(QWEN, sets), cal, world_size=1)
    model = predict_step(load_recipe(QWEN, [*sets, "train.compile_scope=model"]), cal, world_size=1)
    e = cal.elementwise
    logits = (e["eager_bytes_factor"] - e["compiled_bytes_factor"]) * 5 * 4096 * 4 * 151936 / (cal.hbm_gb_s * 1e9)
    assert block["terms"]["elementwise_s"] - model["terms"]["elementwise_s"] == pytest.approx(logits, rel=1e-9)
    assert block["step_s"] > model["step_s"]
