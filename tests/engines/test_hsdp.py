"""HSDP on CPU (gloo): FSDP2 over a 2-D (replicate, shard) mesh of four ranks as 2 × 2, against ``single``.

One `scaletool train --nproc-per-node 4` job with ``parallel.data_parallel_replicate=2`` sees the same global batch
as a one-process run (4 ranks × micro-batch 2 = 8 sequences per step), so with the same seed its loss and
gradient-norm curves equal the one-process run's to float32 summation-order noise: a replica that did not
all-reduce its gradient shard, or a shard group reading another's batch, would be off by far more. The parameters
are 2-D DTensors (replicated over the first mesh dimension, sharded over the second); the checkpoint loads into a
plain model, and a copy stopped after step 2 resumes to the same curve. HSDP × TP (eight ranks as 2 replicas × 2
shards × 2 tensor-parallel ranks, a 3-D mesh) does the same and its checkpoint loads into a plain model. A replica
count that does not divide the ranks, or HSDP with pipeline stages, is one error line before any rank trains.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scaletool.config import load_recipe
from scaletool.model import build_model
from scaletool.train.checkpoint import load_model_weights

pytestmark = pytest.mark.distributed

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
COMMON = ["train.steps=4", "train.checkpoint_every=2", "train.measure_warmup_steps=1"]
HSDP = ["parallel.engine=fsdp", "parallel.data_parallel_replicate=2", "train.micro_batch_size=2"]


def scaletool_train(out: Path, sets: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", *extra]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    single = scaletool_train(root / "single", COMMON + ["train.micro_batch_size=8"])
    assert single.returncode == 0, single.stderr[-3000:]
    hsdp = scaletool_train(root / "hsdp", COMMON + HSDP, "--nproc-per-node", "4")
    assert hsdp.returncode == 0, hsdp.stderr[-3000:]
    again = root / "hsdp-resumed"
    shutil.copytree(root / "hsdp", again)
    shutil.rmtree(again / "checkpoints" / "step_4")
    (again / "summary.json").unlink()
    resumed = scaletool_train(again, COMMON + HSDP, "--nproc-per-node", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    tp = scaletool_train(root / "hsdp-tp", COMMON + HSDP + ["parallel.tensor_parallel=2"], "--nproc-per-node", "8")
    assert tp.returncode == 0, tp.stderr[-3000:]
    return {"single": json.loads(single.stdout), "hsdp": json.loads(hsdp.stdout), "root": root,
            "resumed": json.loads(resumed.stdout), "hsdp-tp": json.loads(tp.stdout)}


def test_hsdp_2x2_matches_one_process(runs):
    s, one = runs["hsdp"], runs["single"]
    assert s["status"] == "completed" and s["environment"]["world_size"] == 4
    assert s["recipe"]["parallel"]["data_parallel_replicate"] == 2
    assert s["tokens_per_step"] == one["tokens_per_step"]
    assert s["history"]["loss"] == pytest.approx(one["history"]["loss"], rel=1e-4)
    assert s["history"]["grad_norm"] == pytest.approx(one["history"]["grad_norm"], rel=1e-3)


def test_hsdp_by_tensor_parallel_2x2x2_matches_one_process(runs):
    s, one = runs["hsdp-tp"], runs["single"]
    assert s["status"] == "completed" and s["environment"]["world_size"] == 8
    assert (s["recipe"]["parallel"]["data_parallel_replicate"], s["recipe"]["parallel"]["tensor_parallel"]) == (2, 2)
    assert s["tokens_per_step"] == one["tokens_per_step"]  # 4 data-parallel ranks × micro-batch 2
    assert s["history"]["loss"] == pytest.approx(one["history"]["loss"], rel=1e-4)
    assert s["history"]["grad_norm"] == pytest.approx(one["history"]["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("name", ["hsdp", "hsdp-tp"])
def test_hsdp_checkpoint_loads_into_a_plain_model(runs, name):
    root = runs["root"]
    weights = {}
    for run in ("single", name):
        model = build_model(load_recipe(TINY).model)
        load_model_weights(root / run / "checkpoints" / "step_4", model)
        weights[run] = model.state_dict()
    for key, value in weights["single"].items():
        assert (weights[name][key] - value).abs().max().item() < 1e-4, key


def test_hsdp_resumes_the_uninterrupted_curve(runs):
    full, resumed = runs["hsdp"], runs["resumed"]
    assert resumed["start_step"] == 2 and resumed["resumed_from"].endswith("step_2")
    assert resumed["history"]["step"] == list(range(4))
    assert resumed["history"]["loss"] == pytest.approx(full["history"]["loss"], rel=1e-5)


@pytest.mark.parametrize("sets, ranks, says", [
    (["parallel.data_parallel_replicate=3"], 2, "3 replicas do not divide the world size 2"),
    (["parallel.data_parallel_replicate=2", "parallel.tensor_parallel=2"], 2,
     "2 replicas × parallel.tensor_parallel=2 do not divide the world size 2"),
    (["parallel.data_parallel_replicate=2", "parallel.pipeline_parallel=2"], 4,
     "HSDP does not compose with parallel.pipeline_parallel"),
])
def test_bad_hsdp_layouts_are_one_error_line(tmp_path, sets, ranks, says):
    p = scaletool_train(tmp_path / "bad", COMMON + ["parallel.engine=fsdp", *sets], "--nproc-per-node", str(ranks))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], p.stderr
    assert not (tmp_path / "bad" / "summary.json").exists()
