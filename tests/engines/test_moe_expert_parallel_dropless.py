"""Expert parallelism for the dropless MoE: one process against 2 and 4 gloo ranks, and the refusals.

Every job trains the same global batch (8 sequences a step) from the same seed. With expert parallelism the
routed rows of each rank go to their experts' ranks in uneven pieces (the dropless dispatch never pads), so a
wrong split size, a wrong regrouping of the received rows, a missing or doubled gradient scale, or an expert
shard that does not match the one-process model would change the losses, the gradient norms (which clipping
makes depend on every gradient) or the per-expert token counts. The router uses sigmoid scores, group-limited
top-2, the aux-loss-free bias updated every step and the balance loss, so routing changes from step to step.
``ep2x2``: 4 ranks in two expert-parallel groups of 2 (experts sharded within a group, replicated across).
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
              "aux_loss_alpha": 0.01, "moe_dispatch": "dropless", "vocab_size": 256, "max_seq_len": 32,
              "dtype": "fp32"},
    "train": {"steps": 4, "seq_len": 32, "lr": 3.0e-3, "warmup_steps": 1, "measure_warmup_steps": 1,
              "grad_clip": 0.5},
}
EP = ["parallel.engine=fsdp", "parallel.expert_parallel=true"]
JOBS = {  # name: (ranks, settings)
    "single": (1, ["parallel.engine=single", "train.micro_batch_size=8"]),
    "ep2": (2, [*EP, "train.micro_batch_size=4"]),
    "ep4": (4, [*EP, "train.micro_batch_size=2"]),
    "ep2x2": (4, [*EP, "parallel.expert_parallel_degree=2", "train.micro_batch_size=2"]),
}


def _recipe(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


def _train(tmp_path, name, ranks, settings, timeout=600):
    cmd = [sys.executable, "-m", "scaletool", "train", str(_recipe(tmp_path)), "--out", str(tmp_path / name), "--json"]
    cmd += ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    for s in settings:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-dropless")
    out = {}
    for name, (ranks, settings) in JOBS.items():
        p = _train(root, name, ranks, settings)
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        out[name] = json.loads(p.stdout)
    return out


def test_single_is_dropless_and_learns(runs):
    s = runs["single"]
    assert s["moe"]["dispatch"] == "dropless" and s["moe"]["experts_per_rank"] == 4
    assert s["loss_last"] < s["loss_first"]
    assert sum(s["moe"]["tokens_per_expert_last_step"]["layer1"]) == 8 * 32 * 2  # nothing dropped


@pytest.mark.parametrize("name, experts_per_rank", [("ep2", 2), ("ep4", 1), ("ep2x2", 2)])
def test_expert_parallel_matches_one_process(runs, name, experts_per_rank):
    ref, run = runs["single"], runs[name]
    assert run["moe"]["dispatch"] == "dropless"
    assert run["moe"]["experts_per_rank"] == experts_per_rank
    assert run["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-4)
    # the norm before clipping (0.5 clips every step here): every gradient, experts' included, at its scale
    assert run["history"]["grad_norm"] == pytest.approx(ref["history"]["grad_norm"], rel=1e-4)
    assert run["moe"]["tokens_per_expert_last_step"] == ref["moe"]["tokens_per_expert_last_step"]
    # the routing was uneven: some expert got more rows than another (uneven all-to-all pieces)
    load = ref["moe"]["tokens_per_expert_last_step"]["layer1"]
    assert max(load) > min(load)


@pytest.mark.parametrize("ranks, settings, line", [
    (3, [*EP], "parallel.expert_parallel: 4 routed experts do not split over 3 ranks"),
    (2, [*EP, "parallel.expert_parallel_degree=4"],
     "parallel.expert_parallel_degree: 4 does not divide the 2 data-parallel ranks (an expert-parallel "
     "group is that many consecutive ranks)"),
    (2, [*EP, "parallel.expert_parallel_degree=3"],
     "parallel.expert_parallel_degree: 4 routed experts do not split over 3 ranks"),
    (2, ["parallel.engine=fsdp", "parallel.expert_parallel_degree=2"],
     "parallel.expert_parallel_degree: needs parallel.expert_parallel=true"),
])
def test_bad_expert_parallel_settings_are_one_error_line(tmp_path, ranks, settings, line):
    p = _train(tmp_path, "bad", ranks, settings, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(line), lines
    assert "Traceback" not in p.stderr and not (tmp_path / "bad").exists()
