"""Pipeline stages × expert parallelism on real gloo process groups (CPU): 4 ranks as 2 stages, each stage's
MoE layers' routed experts split over its 2 data-parallel ranks (``parallel.expert_parallel`` through
:func:`scaletool.engines.expert_parallel.apply_expert_parallel` on each stage's module).

The dropless MoE model (sigmoid routing, group-limited top-2, the sequence-wise balance loss) trains the same
global batch from the same seed on one process and as 2 stages × EP 2: the routed rows cross ranks in uneven
pieces within a stage and the balance losses of the first stage's MoE layer join the backward on their own
stage, so a wrong expert shard, split size, gradient scale or a balance loss lost between stages changes the
loss, the gradient norm (clipping makes it depend on every gradient) or the tokens per expert.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RECIPE = {
    "model": {"attention": "mla", "d_model": 64, "n_layers": 4, "n_heads": 4, "kv_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 192,
              "ffn": "moe", "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "moe_intermediate_size": 48, "first_k_dense_replace": 1, "scoring_func": "sigmoid",
              "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "aux_loss_alpha": 0.5,
              "moe_dispatch": "dropless", "vocab_size": 256, "max_seq_len": 32, "dtype": "fp32"},
    "train": {"steps": 4, "seq_len": 32, "lr": 3.0e-3, "warmup_steps": 1, "measure_warmup_steps": 1,
              "grad_clip": 0.5},
}
JOBS = {  # name: (ranks, settings)
    "single": (1, ["parallel.engine=fsdp", "train.micro_batch_size=8"]),
    "pp2-ep2": (4, ["parallel.engine=fsdp", "parallel.pipeline_parallel=2", "parallel.expert_parallel=true",
                    "train.micro_batch_size=4", "parallel.pipeline_microbatches=2"]),
}


def _train(root, name, ranks, settings, timeout=600):
    path = root / "moe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    cmd = [sys.executable, "-m", "scaletool", "train", str(path), "--out", str(root / name), "--json"]
    cmd += ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    for s in settings:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-ep")
    out = {}
    for name, (ranks, settings) in JOBS.items():
        p = _train(root, name, ranks, settings)
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        out[name] = json.loads(p.stdout)
    return out


def test_two_stages_by_expert_parallel_two_match_one_process(runs):
    ref, run = runs["single"], runs["pp2-ep2"]
    assert run["status"] == "completed" and run["environment"]["world_size"] == 4
    assert run["tokens_per_step"] == ref["tokens_per_step"]
    assert run["moe"]["experts_per_rank"] == 2 and ref["moe"]["experts_per_rank"] == 4
    # the loss reported includes every stage's balance losses, as the one-process model's loss does
    assert run["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-4)
    assert run["history"]["grad_norm"] == pytest.approx(ref["history"]["grad_norm"], rel=1e-4)
    assert run["loss_last"] < run["loss_first"]


def test_the_balance_loss_moves_the_gradients(runs, tmp_path):
    """The same one-process run without the balance loss has another gradient norm: the stage's balance loss
    (compared above) is not a no-op that an engine could drop and still match."""
    p = _train(tmp_path, "no-aux", 1, [*JOBS["single"][1], "model.aux_loss_alpha=0"])
    assert p.returncode == 0, p.stderr[-3000:]
    plain = json.loads(p.stdout)
    assert plain["history"]["grad_norm"][0] != pytest.approx(runs["single"]["history"]["grad_norm"][0], rel=1e-3)
    assert plain["history"]["loss"][0] != pytest.approx(runs["single"]["history"]["loss"][0], rel=1e-3)
