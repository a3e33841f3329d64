"""MoE training, one process against two: FSDP2 with expert parallelism (all-to-all over gloo) and
DeepSpeed ZeRO-2 give the losses of the one-process run with the same seed and global batch.

The recipe routes with sigmoid scores, group-limited top-2 and the aux-loss-free bias updated every
step, plus the sequence-wise balance loss: routing changes from step to step, so any difference in
expert placement, gradient scaling, bias updates (all-reduced load) or balance loss would show in
the losses and the expert loads. Expert parallelism moves the capacity buffer, so every job uses the
capacity dispatch; capacity is large enough that no token is dropped: capacity is per dispatch, and
one process dispatches twice the tokens of each of two ranks.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.distributed

RECIPE = {
    "model": {"attention": "mla", "d_model": 64, "n_layers": 2, "n_heads": 4, "kv_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 192,
              "ffn": "moe", "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "moe_intermediate_size": 48, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
              "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "bias_update_speed": 0.05,
              "aux_loss_alpha": 0.01, "moe_dispatch": "capacity", "capacity_factor": 2.0, "vocab_size": 256,
              "max_seq_len": 32, "dtype": "fp32"},
    "train": {"steps": 5, "seq_len": 32, "lr": 3.0e-3, "warmup_steps": 1, "measure_warmup_steps": 1},
}
JOBS = {
    "single": ["parallel.engine=single", "train.micro_batch_size=8"],
    "fsdp_ep": ["parallel.engine=fsdp", "parallel.expert_parallel=true", "train.micro_batch_size=4"],
    "zero2": ["parallel.engine=deepspeed", "parallel.zero_stage=2", "train.micro_batch_size=4"],
}


def train(tmp_path, name):
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    cmd = [sys.executable, "-m", "scaletool", "train", str(recipe), "--out", str(tmp_path / name), "--json"]
    cmd += ["--nproc-per-node", "2"] if name != "single" else []
    for s in JOBS[name]:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: train(root, name) for name in JOBS}


def test_single_learns_and_reports_expert_load(runs):
    s = runs["single"]
    assert s["loss_last"] < s["loss_first"]
    load = s["moe"]["tokens_per_expert_last_step"]["layer1"]
    assert sum(load) == 8 * 32 * 2  # every (token, choice) of the step's batch, counted once
    m = s["metrics"]
    assert m["moe/dropped_fraction"] == 0 and m["moe/imbalance_ratio_max"] >= 1
    assert (s["moe"]["dispatch"], s["moe"]["expert_gemm"]) == ("capacity", "bmm")
    rows = [json.loads(line) for line in open(f"{s['out_dir']}/metrics.jsonl")]
    assert any("moe/layer1/imbalance_ratio" in r for r in rows)


@pytest.mark.parametrize("name, experts_per_rank", [("fsdp_ep", 2), ("zero2", 4)])
def test_two_processes_match_one(runs, name, experts_per_rank):
    ref, run = runs["single"], runs[name]
    assert run["moe"]["experts_per_rank"] == experts_per_rank
    assert run["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-4)
    assert run["moe"]["tokens_per_expert_last_step"] == ref["moe"]["tokens_per_expert_last_step"]
