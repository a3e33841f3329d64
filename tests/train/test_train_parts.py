"""Hardware profiles, schedule, DeepSpeed config building, metrics writer, NVML fallback, data sharding."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from scaletool.analytic.zero3 import block_params
from scaletool.config import load_recipe
from scaletool.engines.deepspeed import deepspeed_config
from scaletool.measure.hardware import peak_for
from scaletool.measure.nvml import NvmlSampler
from scaletool.train.data import ByteTokenizer, make_source
from scaletool.train.metrics import MetricsWriter
from scaletool.train.schedule import lr_at

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")


@pytest.mark.parametrize("name, dtype, tflops, profile", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989, "H100 SXM"),
    ("NVIDIA H100 PCIe", "bf16", 756, "H100 PCIe"),
    ("NVIDIA H200", "bf16", 989, "H200"),
    ("NVIDIA A100-SXM4-80GB", "fp16", 312, "A100"),
    ("NVIDIA H100 80GB HBM3", "fp32", 67, "H100 SXM"),
])
def test_known_gpus_match_their_profile(name, dtype, tflops, profile):
    p = peak_for("cuda", name, dtype)
    assert (p.tflops, p.profile, p.warning) == (tflops, profile, None)


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA H200 NVL"])
def test_unknown_gpu_warns_and_invents_nothing(name):
    p = peak_for("cuda", name, "bf16")
    assert p.tflops is None and name in p.warning and "--peak-tflops" in p.warning
    assert peak_for("cuda", name, "bf16", 123.0).tflops == 123.0


def test_cpu_has_no_peak_unless_given():
    assert peak_for("cpu", "cpu", "fp32").tflops is None
    assert peak_for("cpu", "cpu", "fp32", 2.5).tflops == 2.5


def test_schedule_warms_up_then_decays_to_the_floor():
    t = load_recipe(TINY, ["train.steps=20", "train.warmup_steps=4", "train.lr=1.0", "train.min_lr_ratio=0.1"]).train
    lrs = [lr_at(s, t) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_deepspeed_config_from_recipe_with_passthrough_merged():
    r = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=3", "model.dtype=bf16",
                           "train.grad_accum_steps=2",
                           "parallel.deepspeed={zero_optimization: {reduce_bucket_size: 1000, stage: 3}, "
                           "bf16: {enabled: true}}"])
    cfg, problems = deepspeed_config(r, 4)
    assert problems == []
    assert cfg["train_batch_size"] == 4 * 2 * 4 and cfg["gradient_accumulation_steps"] == 2
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["reduce_bucket_size"] == 1000 and z["overlap_comm"] is True
    assert z["offload_param"] == {"device": "none"} and cfg["bf16"] == {"enabled": True}


def test_zero3_defaults_are_sized_by_the_block_and_the_passthrough_wins():
    r = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=3"])
    block = block_params(r.model)
    z = deepspeed_config(r, 2)[0]["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == z["reduce_bucket_size"] == 2 * block
    assert z["leaf_module"] == {"classes": ["scaletool.model.transformer.Block"]}
    assert z["stage3_param_persistence_threshold"] == 100_000
    old = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=3",
                             "parallel.deepspeed={zero_optimization: {leaf_module: {classes: []}, reduce_bucket_size: 7}}"])
    z = deepspeed_config(old, 2)[0]["zero_optimization"]
    assert z["leaf_module"] == {"classes": []} and z["reduce_bucket_size"] == 7
    assert z["stage3_prefetch_bucket_size"] == 2 * block
    # ZeRO-2 keeps the fixed bucket and gets no ZeRO-3 keys
    z2 = deepspeed_config(load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=2"]), 2)[0]["zero_optimization"]
    assert z2["reduce_bucket_size"] == 500_000_000 and not any(k.startswith("stage3_") or k == "leaf_module" for k in z2)


def test_zero_knobs_are_checked_one_line_each():
    r = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=2", "parallel.deepspeed={zero_optimization: "
                           "{stage3_prefetch_bucket_size: 5e7, overlap_comm: 1, reduce_bucket_size: 0, "
                           "leaf_module: {classes: X}}}"])
    problems = r.engine_problems(2)
    assert "parallel.deepspeed.zero_optimization.reduce_bucket_size: a whole number of elements >= 1, got 0" in problems
    assert any("stage3_prefetch_bucket_size: a whole number" in p and "write 50000000" in p for p in problems)
    assert any("overlap_comm: expected true or false, got 1" in p for p in problems)
    assert any(p.startswith("parallel.deepspeed.zero_optimization.leaf_module: a mapping") for p in problems)
    assert any("stage3_prefetch_bucket_size: only ZeRO-3 reads it, but parallel.zero_stage=2" in p for p in problems)
    assert len(problems) == 6
    good = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=3", "parallel.deepspeed={zero_optimization: "
                              "{stage3_prefetch_bucket_size: 5.0e+7, overlap_comm: false, leaf_module: {classes: []}}}"])
    assert good.engine_problems(2) == []


def test_deepspeed_conflicts_are_one_line_each():
    r = load_recipe(TINY, ["parallel.engine=deepspeed", "parallel.zero_stage=1",
                           "parallel.deepspeed={zero_optimization: {stage: 2}, train_micro_batch_size_per_gpu: 9, "
                           "optimizer: {type: Adam}}"])
    _, problems = deepspeed_config(r, 2)
    assert len(problems) == 3
    assert any("zero_optimization.stage=2 conflicts with parallel.zero_stage (= 1)" in p for p in problems)
    assert any("train_micro_batch_size_per_gpu=9 conflicts with train.micro_batch_size (= 4)" in p for p in problems)
    assert any(p.startswith("parallel.deepspeed.optimizer:") for p in problems)


def test_metrics_writer_json_has_no_nan_and_other_ranks_write_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "a", enabled=True, tensorboard=False, quiet=True)
    w.scalars(0, {"loss/train": float("nan"), "time/step_s": 0.5})
    w.summary({"mfu": float("inf"), "metrics": {}})
    w.close()
    row = json.loads((tmp_path / "a" / "metrics.jsonl").read_text())
    assert row == {"step": 0, "loss/train": None, "time/step_s": 0.5}
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["mfu"] is None
    off = MetricsWriter(tmp_path / "b", enabled=False)
    off.scalars(0, {"loss/train": 1.0})
    assert off.summary({}) is None and not (tmp_path / "b").exists()


def test_nvml_without_gpu_is_a_noop_with_a_note():
    s = NvmlSampler(None).start()
    s.stop()
    assert not s.active and s.summary() == {"samples": 0, "interval_s": 0.1, "note": "no GPU: NVML sampling off"}


def test_ranks_read_disjoint_shards_of_the_same_global_batch():
    one = make_source(load_recipe(TINY, ["train.micro_batch_size=4"]), 0, 1)
    r2 = load_recipe(TINY, ["train.micro_batch_size=2"])
    a, b = make_source(r2, 0, 2), make_source(r2, 1, 2)
    x1, y1 = one.batch(step=5, micro=0)
    x2 = torch.cat([a.batch(5, 0)[0], b.batch(5, 0)[0]])
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(one.batch(6, 0)[0], x1)
    # the bigram structure: every odd position is a fixed function of the token before it
    pairs = {(int(p), int(q)) for p, q in zip(x1[:, 0::2].flatten(), x1[:, 1::2].flatten())}
    assert len({p for p, _ in pairs}) == len(pairs)


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("naïve ✓")
    assert max(ids) < 256 and tok.decode(ids + [tok.eos_id]) == "naïve ✓" and tok.vocab_size == 257
    assert math.isclose(len(ids), len("naïve ✓".encode()))


def test_clipping_inside_fused_adamw_equals_clipping_before_it():
    """The single engine folds the clip coefficient into fused AdamW's grad_scale: same update as
    clip_grad_norm_ then step, and different from no clipping (the clip is active here)."""
    from scaletool.engines import init_distributed, make_engine

    r = load_recipe(TINY, ["train.fused_optimizer=true", "train.grad_clip=0.05", "train.lr=0.01"])
    env = init_distributed("single")
    batches = [make_source(r, 0, 1).batch(0, 0)]
    folded, before, unclipped = make_engine(r, env), make_engine(r, env), make_engine(r, env)
    assert folded.clip_in_optimizer and before.clip_in_optimizer
    before.clip_in_optimizer = False
    unclipped.grad_clip = 0.0
    _, n_folded = folded.train_step(batches, 0.01)
    _, n_before = before.train_step(batches, 0.01)
    unclipped.train_step(batches, 0.01)
    assert float(n_folded) == pytest.approx(float(n_before), rel=1e-6) and float(n_folded) > 10 * 0.05
    for a, b, _c in zip(folded.model.parameters(), before.model.parameters(), unclipped.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(a, c, rtol=1e-3, atol=1e-6)
               for a, c in zip(folded.model.parameters(), unclipped.model.parameters()))


def test_mixed_precision_keeps_a_16_bit_residual_stream():
    """Under autocast the embedding output is cast to the autocast dtype, so every block's input
    (the residual stream) is 16-bit, as under FSDP2's policy; without autocast it stays fp32."""
    from scaletool.model import build_model

    r = load_recipe(TINY)
    model = build_model(r.model, "cpu", seed=0)
    tokens = make_source(r, 0, 1).batch(0, 0)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        states = model.hidden_states(tokens)
    assert {s.dtype for s in states[:-1]} == {torch.bfloat16}
    assert {s.dtype for s in model.hidden_states(tokens)} == {torch.float32}
