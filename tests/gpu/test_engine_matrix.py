"""Every layout plan can offer runs on real GPUs: each engine × eager/compiled × checkpointing none/selective/full ×
tensor parallelism where it applies, at 1, 2 and 4 GPUs, on an MLA model (mla-1b) and a GQA model with tied
embeddings and a 151,936-token vocabulary (Qwen2.5-1.5B's config.json), both cut to 2 layers at T = 512.

Each job is a real ``scaletool train --nproc-per-node N`` (NCCL) of 3 steps with the same seed and global batch
(8 sequences per step: micro-batch 8 / data-parallel ranks); its loss curve must match the one-GPU eager run's
to bf16 noise (2%; a gradient summed twice or a head split the wrong way is far off). Skipped without CUDA;
jobs that need more GPUs than there are are skipped one by one.

    python -m pytest tests/gpu/test_engine_matrix.py -q -rs -k "mla and g2"     # one model at one GPU count
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletool.config import RecipeError
from scaletool.hf import load_recipe

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(GPUS < 1, reason="needs CUDA GPUs")]

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "mla": (str(ROOT / "recipes" / "mla-1b.yaml"), []),
    "qwen": (str(ROOT / "tests" / "hf_configs" / "qwen2.5-1.5b.json"), []),
}
COMMON = ["model.n_layers=2", "train.seq_len=512", "train.steps=3", "train.measure_warmup_steps=1",
          "train.checkpoint_every=0"]
GLOBAL_BATCH = 8
#: (label, engine keys, tensor-parallel degree) per GPU count
ENGINES = {
    1: [("single", ["parallel.engine=single"], 1)],
    2: [("ddp", ["parallel.engine=ddp"], 1), ("fsdp", ["parallel.engine=fsdp"], 1),
        *[(f"zero{s}", ["parallel.engine=deepspeed", f"parallel.zero_stage={s}"], 1) for s in (1, 2, 3)],
        ("fsdp-tp2", ["parallel.engine=fsdp", "parallel.tensor_parallel=2"], 2)],
    4: [("ddp", ["parallel.engine=ddp"], 1), ("fsdp", ["parallel.engine=fsdp"], 1),
        *[(f"zero{s}", ["parallel.engine=deepspeed", f"parallel.zero_stage={s}"], 1) for s in (1, 2, 3)],
        ("fsdp-tp2", ["parallel.engine=fsdp", "parallel.tensor_parallel=2"], 2),
        ("tp4", ["parallel.engine=fsdp", "parallel.tensor_parallel=4"], 4)],
}
ALL = {
    f"{model}-g{gpus}-{label}-{ckpt}-{'compiled' if compiled else 'eager'}": (model, gpus, [
        *keys, f"train.micro_batch_size={GLOBAL_BATCH // (gpus // tp)}", f"train.activation_checkpointing={ckpt}",
        f"train.compile={str(compiled).lower()}"])
    for model in MODELS for gpus, rows in ENGINES.items() for label, keys, tp in rows
    for ckpt in ("none", "selective", "full") for compiled in (False, True)
}


def _refused(model: str, gpus: int, sets: list[str]) -> list[str]:
    """What the recipe rules refuse in a job (Qwen's 2 K/V heads do not split over TP = 4): not a layout."""
    try:
        return load_recipe(MODELS[model][0], COMMON + MODELS[model][1] + sets).engine_problems(gpus)
    except RecipeError as e:
        return e.problems


JOBS = {name: job for name, job in ALL.items() if not _refused(*job)}


def train(out: Path, model: str, sets: list[str], gpus: int) -> subprocess.CompletedProcess:
    recipe, extra = MODELS[model]
    cmd = [sys.executable, "-m", "scaletool", "train", recipe, "--out", str(out), "--json", "--nproc-per-node", str(gpus)]
    for s in COMMON + extra + sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """model -> its one-GPU eager run (the summary, or the end of stderr), run once when first asked for."""
    root, done = tmp_path_factory.mktemp("ref"), {}

    def reference(model: str):
        if model not in done:
            p = train(root / model, model, ["parallel.engine=single", f"train.micro_batch_size={GLOBAL_BATCH}"], 1)
            done[model] = json.loads(p.stdout) if p.returncode == 0 else p.stderr[-3000:]
        return done[model]
    return reference


@pytest.mark.parametrize("name", list(JOBS))
def test_layout_runs_and_matches_one_gpu(references, tmp_path, name):
    model, gpus, sets = JOBS[name]
    if gpus > GPUS:
        pytest.skip(f"needs {gpus} GPUs, found {GPUS}")
    ref = references(model)
    assert isinstance(ref, dict), ref
    p = train(tmp_path / "run", model, sets, gpus)
    assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
    s = json.loads(p.stdout)
    assert s["status"] == "completed" and s["environment"]["world_size"] == gpus
    assert s["tokens_per_step"] == ref["tokens_per_step"]
    assert s["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=2e-2), f"{name} under torch {torch.__version__}"
    assert s["memory"]["measured_peak_allocated_bytes"] > 0  # CUDA's allocator peak, beside the estimate
