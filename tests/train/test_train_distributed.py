"""Real two-process torchrun jobs (gloo, CPU) for ddp, fsdp and DeepSpeed ZeRO-1/2/3 on the tiny recipe.

Every job is started once, through `scaletool train --nproc-per-node 2` (which re-executes itself
under `python -m torch.distributed.run`), and the tests read their summaries and checkpoints:

- each sharded run sees the same global batch as a one-process `single` run (8 sequences per step:
  2 ranks × micro-batch 4, or 2 ranks × micro-batch 2 × 2 accumulation steps), so with the same
  seed the loss curves agree to float32 summation-order noise (rtol 1e-4);
- each job saves at step 3 and 6; a copy of its run directory without the step-6 checkpoint (and
  summary, as if killed there) is resumed and must reproduce steps 3-5 of the uninterrupted curve;
- the trained weights, loaded into a plain model from every checkpoint format, agree;
- the ddp job runs with 2 cores to share and no OMP_NUM_THREADS: each rank takes one thread.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletool.analytic.zero3 import block_params
from scaletool.config import load_recipe
from scaletool.engines.serialization import UnsafeCheckpointError
from scaletool.model import build_model
from scaletool.threads import SHARE_ENV
from scaletool.train.checkpoint import load_model_weights

pytestmark = pytest.mark.distributed

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
COMMON = ["train.steps=6", "train.checkpoint_every=3", "train.measure_warmup_steps=1"]
JOBS = {
    "ddp": ["parallel.engine=ddp", "train.micro_batch_size=4"],
    "fsdp": ["parallel.engine=fsdp", "train.micro_batch_size=2", "train.grad_accum_steps=2"],
    "zero1": ["parallel.engine=deepspeed", "parallel.zero_stage=1", "train.micro_batch_size=4"],
    "zero2": ["parallel.engine=deepspeed", "parallel.zero_stage=2", "train.micro_batch_size=2",
              "train.grad_accum_steps=2"],
    "zero3": ["parallel.engine=deepspeed", "parallel.zero_stage=3", "train.micro_batch_size=4"],
}
RESUMED = ("ddp", "fsdp", "zero3")


def scaletool_train(out: Path, sets: list[str], *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", *extra]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    out = {}
    p = scaletool_train(root / "single", COMMON + ["train.micro_batch_size=8"])
    assert p.returncode == 0, p.stderr
    out["single"], out["single-stderr"] = json.loads(p.stdout), p.stderr
    two_cores = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {SHARE_ENV: "2"}
    for name, sets in JOBS.items():
        p = scaletool_train(root / name, COMMON + sets, "--nproc-per-node", "2", env=two_cores if name == "ddp" else None)
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        out[name] = json.loads(p.stdout)
        out[f"{name}-stderr"] = p.stderr
        if name in RESUMED:
            again = root / f"{name}-resumed"
            shutil.copytree(root / name, again)
            shutil.rmtree(again / "checkpoints" / "step_6")
            (again / "summary.json").unlink()
            p = scaletool_train(again, COMMON + sets, "--nproc-per-node", "2", "--resume")
            assert p.returncode == 0, f"{name} resume: {p.stderr[-3000:]}"
            out[f"{name}-resumed"] = json.loads(p.stdout)
    out["root"] = root
    return out


@pytest.mark.parametrize("name", list(JOBS))
def test_two_rank_run_learns_and_matches_single(runs, name):
    s = runs[name]
    assert s["status"] == "completed" and s["environment"]["world_size"] == 2
    assert s["environment"]["backend"] == "gloo"
    assert s["loss_last"] < s["loss_first"] - 0.3
    assert s["tokens_per_step"] == runs["single"]["tokens_per_step"]
    assert s["history"]["loss"] == pytest.approx(runs["single"]["history"]["loss"], rel=1e-4)
    assert s["history"]["grad_norm"] == pytest.approx(runs["single"]["history"]["grad_norm"], rel=1e-3)
    assert "FutureWarning" not in runs[f"{name}-stderr"]  # ZeRO's deprecated-collective warnings are silenced


def test_two_ranks_on_two_cores_take_one_thread_each(runs):
    s = runs["ddp"]
    assert s["threads"] == 1 and s["environment"]["threads_per_rank"] == [1, 1]


def test_zero3_runs_with_block_sized_defaults_and_records_its_config(runs):
    """The zero3 job above (losses equal to single's) ran with each block a leaf module and the
    block-sized buckets; the result records the config DeepSpeed was given."""
    z = runs["zero3"]["environment"]["deepspeed_config"]["zero_optimization"]
    block = block_params(load_recipe(TINY).model)
    assert z["stage"] == 3 and z["leaf_module"] == {"classes": ["scaletool.model.transformer.Block"]}
    assert z["stage3_prefetch_bucket_size"] == z["reduce_bucket_size"] == 2 * block
    assert "leaf_module" not in runs["zero2"]["environment"]["deepspeed_config"]["zero_optimization"]
    assert "deepspeed_config" not in runs["fsdp"]["environment"]


@pytest.mark.parametrize("name", RESUMED)
def test_resume_continues_the_uninterrupted_curve(runs, name):
    full, resumed = runs[name], runs[f"{name}-resumed"]
    assert resumed["start_step"] == 3 and resumed["steps_completed"] == 6
    assert resumed["resumed_from"].endswith("step_3")
    assert resumed["history"]["step"] == list(range(6))
    assert resumed["history"]["loss"] == pytest.approx(full["history"]["loss"], rel=1e-5)
    assert [(g["start_step"], g["end_step"]) for g in resumed["segments"]] == [(0, 3), (3, 6)]


def test_checkpoint_formats_load_into_a_plain_model(runs):
    # the single engine saves without a process group, as intended: torch's warning about it is silenced
    assert "torch.distributed is disabled" not in runs["single-stderr"]
    cfg = load_recipe(TINY).model
    root = runs["root"]
    weights = {}
    for name in ("single", "ddp", "fsdp", "zero1", "zero3"):
        model = build_model(cfg, "cpu", seed=99)
        # ZeRO-3's partitions are gathered by DeepSpeed's zero_to_fp32, which needs full pickle
        load_model_weights(root / name / "checkpoints" / "step_6", model, trust_checkpoint=name == "zero3")
        weights[name] = model.state_dict()
    with pytest.raises(UnsafeCheckpointError, match="ZeRO-3 checkpoint.*trust_checkpoint"):
        load_model_weights(root / "zero3" / "checkpoints" / "step_6", build_model(cfg, "cpu", seed=99))
    fresh = build_model(cfg, "cpu", seed=1234).state_dict()
    for name, sd in weights.items():
        assert not torch.allclose(sd["layers.0.attn.wkv_a.weight"], fresh["layers.0.attn.wkv_a.weight"])
        for k, v in weights["single"].items():
            torch.testing.assert_close(sd[k], v, rtol=1e-3, atol=1e-4, msg=f"{name}: {k}")


def test_bad_nproc_and_engine_fail_with_one_line_before_any_rank_starts(tmp_path):
    p = scaletool_train(tmp_path / "a", ["parallel.engine=ddp", "parallel.nproc_per_node=4"], "--nproc-per-node", "2")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: parallel.nproc_per_node: the recipe says 4, but this job has 2 processes per node; "
        "make them agree (or drop the key)"]
    p = scaletool_train(tmp_path / "b", [], "--nproc-per-node", "2")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "parallel.engine: single runs one process, but this job has 2 ranks" in p.stderr
