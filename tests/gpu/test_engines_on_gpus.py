"""Every engine on real GPUs, under whatever torch this machine runs (NCCL, not gloo): skipped below two GPUs.

The CPU suite runs under CI's torch; cluster images pin their own, older or newer. Here each job is a real
``scaletool train --nproc-per-node N`` launch of the tiny recipe (fp32, 4 steps), as a user starts one:
DDP, FSDP2, DeepSpeed ZeRO-1/2/3 on 2 GPUs, tensor parallelism TP=2 for MHA and MLA, eager and compiled
(per-block compile after the split), compiled with async TP, and on 4 GPUs FSDP2 × TP 2×2. With the same
seed and global batch (8 sequences per step) every loss curve must equal the one-GPU run's to float32
summation-order noise; a head split the wrong way or a gradient summed twice is orders of magnitude off.

    python -m pytest tests/gpu -q -rs      # about 5 minutes on 2 GPUs
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
COMMON = ["train.steps=4", "train.measure_warmup_steps=1"]
TP = ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=8"]
#: job -> (GPUs, overrides)
JOBS = {
    "ddp": (2, ["parallel.engine=ddp", "train.micro_batch_size=4"]),
    "fsdp": (2, ["parallel.engine=fsdp", "train.micro_batch_size=4"]),
    "zero1": (2, ["parallel.engine=deepspeed", "parallel.zero_stage=1", "train.micro_batch_size=4"]),
    "zero2": (2, ["parallel.engine=deepspeed", "parallel.zero_stage=2", "train.micro_batch_size=4"]),
    "zero3": (2, ["parallel.engine=deepspeed", "parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "tp2-mha": (2, TP + ["model.attention=mha"]),
    "tp2-mla": (2, TP),
    "tp2-mha-compiled": (2, TP + ["model.attention=mha", "train.compile=true"]),
    "tp2-mla-compiled": (2, TP + ["train.compile=true"]),
    "tp2-mla-async": (2, TP + ["train.compile=true", "parallel.async_tp=true"]),
    "tp2-mla-local": (2, TP + ["parallel.tp_local_ops=true"]),
    "tp2-mla-local-compiled": (2, TP + ["parallel.tp_local_ops=true", "train.compile=true"]),
    "tp2-mha-local-compiled": (2, TP + ["parallel.tp_local_ops=true", "model.attention=mha", "train.compile=true"]),
    "2x2-mha": (4, ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=4",
                    "model.attention=mha"]),
    "2x2-mla": (4, ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=4"]),
}


def reference(name: str) -> str:
    return "single-mha" if "mha" in name else "single"


def train(out: Path, sets: list[str], gpus: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", "--nproc-per-node", str(gpus)]
    for s in COMMON + sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    done = {}
    for name, (gpus, sets) in {"single": (1, ["train.micro_batch_size=8"]),
                               "single-mha": (1, ["train.micro_batch_size=8", "model.attention=mha"]),
                               **JOBS}.items():
        if gpus > GPUS:
            continue
        p = train(root / name, sets, gpus)
        done[name] = json.loads(p.stdout) if p.returncode == 0 else p.stderr[-3000:]
    return done


@pytest.mark.parametrize("name", list(JOBS))
def test_engine_runs_on_gpus_and_matches_one_gpu(runs, name):
    if JOBS[name][0] > GPUS:
        pytest.skip(f"needs {JOBS[name][0]} GPUs")
    s, ref = runs[name], runs[reference(name)]
    assert isinstance(ref, dict), ref
    assert isinstance(s, dict), s
    env = s["environment"]
    assert s["status"] == "completed" and env["device_type"] == "cuda" and env["world_size"] == JOBS[name][0]
    assert s["tokens_per_step"] == ref["tokens_per_step"]
    assert s["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-3), f"{name} under torch {env['torch']}"
