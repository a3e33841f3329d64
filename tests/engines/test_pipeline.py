"""Pipeline stages on real gloo process groups (``torch.distributed.pipelining`` over FSDP2, CPU).

The tiny MLA recipe cut to 4 blocks trains 4 steps once on one process (``fsdp``, micro-batch 4) and then
as 2 pipeline stages under each schedule the installed torch runs with FSDP2 (2 ranks), and as 2 stages × 2
FSDP2 shards (4 ranks, micro-batch 2 per data-parallel rank), and as 2 stages × 2 tensor-parallel ranks (1F1B; and
interleaved with the local-ops split): the same global batch and seed, so the loss and gradient-norm curves equal
the one-process run's to float32 summation noise. A GQA model with MoE FFNs
(dense first block) does the same. The 1F1B and the pipeline × TP jobs save at step 2; a copy without the step-4
checkpoint resumes and reproduces the curve. Bad pipeline settings are one ``error:`` line and exit 2, before any rank starts.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
COMMON = ["train.steps=4", "train.measure_warmup_steps=1", "model.n_layers=4", "train.checkpoint_every=2"]
PP = ["parallel.engine=fsdp", "parallel.pipeline_parallel=2"]
MOE = ["model.ffn=moe", "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
       "model.first_k_dense_replace=1", "model.attention=gqa", "model.n_kv_heads=2"]
JOBS = {  # name -> (ranks, sets, reference)
    "1f1b": (2, PP + ["train.micro_batch_size=4"], "single"),
    "gpipe": (2, PP + ["train.micro_batch_size=4", "parallel.pipeline_schedule=gpipe",
                       "parallel.pipeline_microbatches=2"], "single"),
    "interleaved": (2, PP + ["train.micro_batch_size=4", "parallel.pipeline_schedule=interleaved-1f1b",
                             "parallel.pipeline_virtual_stages=2"], "single"),
    "pp2xdp2": (4, PP + ["train.micro_batch_size=2"], "single"),
    "pp2xdp2-interleaved-accum": (4, PP + ["train.micro_batch_size=1", "train.grad_accum_steps=2",
                                           "parallel.pipeline_schedule=interleaved-1f1b",
                                           "parallel.pipeline_virtual_stages=2"], "single"),
    "moe": (2, PP + MOE + ["train.micro_batch_size=4"], "single-moe"),
    # tensor parallelism within each stage: 2 stages × 2 tensor-parallel ranks (sequence-parallel residual stream
    # across the stage boundary, vocabulary-sharded logits and loss parallelism on the last stage)
    "pp2xtp2": (4, PP + ["train.micro_batch_size=4", "parallel.tensor_parallel=2"], "single"),
    "pp2xtp2-interleaved-local": (4, PP + ["train.micro_batch_size=4", "parallel.tensor_parallel=2",
                                          "parallel.pipeline_schedule=interleaved-1f1b",
                                          "parallel.pipeline_virtual_stages=2", "parallel.tp_local_ops=true"], "single"),
}


def train(out: Path, sets: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", *extra]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    out = {}
    for name, sets in (("single", ["parallel.engine=fsdp", "train.micro_batch_size=4"]),
                       ("single-moe", ["parallel.engine=fsdp", "train.micro_batch_size=4", *MOE])):
        p = train(root / name, COMMON + sets)
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = json.loads(p.stdout)
    for name, (ranks, sets, _) in JOBS.items():
        p = train(root / name, COMMON + sets, "--nproc-per-node", str(ranks))
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        out[name] = json.loads(p.stdout)
    for name in ("1f1b", "pp2xtp2"):
        again = root / f"{name}-resumed"
        shutil.copytree(root / name, again)
        shutil.rmtree(again / "checkpoints" / "step_4")
        (again / "summary.json").unlink()
        p = train(again, COMMON + JOBS[name][1], "--nproc-per-node", str(JOBS[name][0]), "--resume")
        assert p.returncode == 0, p.stderr[-3000:]
        out[f"{name}-resumed"] = json.loads(p.stdout)
    return out


@pytest.mark.parametrize("name", list(JOBS))
def test_pipeline_loss_curve_equals_one_process(runs, name):
    ranks, _, ref = JOBS[name]
    s, r = runs[name], runs[ref]
    assert s["status"] == "completed" and s["environment"]["world_size"] == ranks
    assert s["tokens_per_step"] == r["tokens_per_step"]
    assert s["history"]["loss"] == pytest.approx(r["history"]["loss"], rel=1e-5)
    assert s["history"]["grad_norm"] == pytest.approx(r["history"]["grad_norm"], rel=1e-4)
    assert s["loss_last"] < s["loss_first"]


@pytest.mark.parametrize("name", ["1f1b", "pp2xtp2"])
def test_pipeline_resume_continues_the_uninterrupted_curve(runs, name):
    full, resumed = runs[name], runs[f"{name}-resumed"]
    assert resumed["start_step"] == 2 and resumed["resumed_from"].endswith("step_2")
    assert resumed["history"]["loss"] == pytest.approx(full["history"]["loss"], rel=1e-5)


@pytest.mark.parametrize("sets, ranks, says", [
    (PP + ["parallel.pipeline_parallel=8"], 8, "8 stages, more than model.n_layers=4"),
    (PP + ["train.micro_batch_size=4", "parallel.pipeline_microbatches=3"], 2, "3 does not divide train.micro_batch_size=4"),
    (PP + ["parallel.pipeline_schedule=zbv", "parallel.pipeline_virtual_stages=2"], 2, "weight gradients go missing"),
    (PP + ["parallel.pipeline_schedule=interleaved-1f1b"], 2, "interleaves >= 2 chunks per rank"),
    (PP + ["model.tie_embeddings=true"], 2, "tied weight"),
    (["parallel.engine=ddp", "parallel.pipeline_parallel=2"], 2, "compose with parallel.engine=fsdp"),
    (PP + ["parallel.pipeline_parallel=3", "model.n_layers=6"], 2, "3 does not divide the world size 2"),
    (PP + ["parallel.tensor_parallel=2"], 2, "2 × parallel.tensor_parallel=2 does not divide the world size 2"),
    (PP + ["parallel.tensor_parallel=2", "parallel.async_tp=true", "train.compile=true"], 4,
     "parallel.async_tp: not composed with pipeline"),
])
def test_bad_pipeline_settings_are_one_error_line(tmp_path, sets, ranks, says):
    p = train(tmp_path / "run", COMMON + sets, "--nproc-per-node", str(ranks))
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(errors) == 1 and says in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
