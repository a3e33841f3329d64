"""Pipeline stages on real GPUs (NCCL): PP = 2 × FSDP2 = 2, PP = 2 × TP = 2 and PP = 4 on 4 GPUs, PP = 2 on 2;
skipped below 2.

Each job is a real ``scaletool train --nproc-per-node N`` launch of the tiny MLA recipe cut to 8 blocks (fp32,
4 steps) with the same seed and global batch (8 sequences per step) as a one-GPU FSDP2 run, under 1F1B,
GPipe and interleaved 1F1B, eager and compiled: every loss and gradient-norm curve must equal the one-GPU
run's to float32 summation-order noise (a stage boundary that drops a gradient is orders of magnitude off).

    python -m pytest tests/gpu/test_pipeline_on_gpus.py -q -rs      # about 3 minutes on 4 GPUs
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, found {GPUS}")]

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
COMMON = ["train.steps=4", "train.measure_warmup_steps=1", "model.n_layers=8", "parallel.engine=fsdp"]
#: job -> (GPUs, overrides)
JOBS = {
    "pp2": (2, ["parallel.pipeline_parallel=2", "train.micro_batch_size=8"]),
    "pp2-gpipe": (2, ["parallel.pipeline_parallel=2", "train.micro_batch_size=8", "parallel.pipeline_schedule=gpipe"]),
    "pp2x2": (4, ["parallel.pipeline_parallel=2", "train.micro_batch_size=4"]),
    "pp2x2-interleaved-compiled": (4, ["parallel.pipeline_parallel=2", "train.micro_batch_size=4", "train.compile=true",
                                       "parallel.pipeline_schedule=interleaved-1f1b",
                                       "parallel.pipeline_virtual_stages=2"]),
    "pp4": (4, ["parallel.pipeline_parallel=4", "train.micro_batch_size=8"]),
    "pp4-interleaved": (4, ["parallel.pipeline_parallel=4", "train.micro_batch_size=8",
                            "parallel.pipeline_schedule=interleaved-1f1b", "parallel.pipeline_virtual_stages=2"]),
    # tensor parallelism inside the stages: 2 stages × 2 tensor-parallel ranks, eager and each block compiled
    "pp2xtp2": (4, ["parallel.pipeline_parallel=2", "parallel.tensor_parallel=2", "train.micro_batch_size=8"]),
    "pp2xtp2-compiled": (4, ["parallel.pipeline_parallel=2", "parallel.tensor_parallel=2", "train.micro_batch_size=8",
                             "train.compile=true"]),
}


def train(out: Path, sets: list[str], gpus: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", "--nproc-per-node", str(gpus)]
    for s in COMMON + sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    p = train(tmp_path_factory.mktemp("pp") / "single", ["train.micro_batch_size=8"], 1)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("name", list(JOBS))
def test_pipeline_on_gpus_equals_one_gpu(single, name, tmp_path):
    gpus, sets = JOBS[name]
    if gpus > GPUS:
        pytest.skip(f"needs {gpus} GPUs, found {GPUS}")
    p = train(tmp_path / name, sets, gpus)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["environment"]["backend"] == "nccl" and s["environment"]["world_size"] == gpus
    assert s["tokens_per_step"] == single["tokens_per_step"]
    assert s["history"]["loss"] == pytest.approx(single["history"]["loss"], rel=1e-4)
    assert s["history"]["grad_norm"] == pytest.approx(single["history"]["grad_norm"], rel=1e-3)
