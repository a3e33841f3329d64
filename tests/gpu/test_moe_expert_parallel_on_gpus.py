"""Expert parallelism for the dropless MoE on real GPUs (NCCL): skipped below two GPUs.

A tiny MoE (4 routed experts, top-2, one shared) trains 4 steps on one GPU and with its experts split over 2
GPUs (and, with 4 GPUs, over 4 and over two groups of 2): the dropless dispatch's uneven all-to-all under
NCCL, on the grouped GEMM where the card has it, eager and compiled per block. The loss curves and gradient
norms equal the one-GPU run's to float32 summation-order noise, and the per-expert token counts agree.

    python -m pytest tests/gpu/test_moe_expert_parallel_on_gpus.py -q -rs   # about 2 minutes on 4 GPUs
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
MOE = ["model.ffn=moe", "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
       "model.moe_intermediate_size=64", "model.first_k_dense_replace=1", "model.moe_dispatch=dropless",
       "model.dtype=fp32", "train.steps=4", "train.measure_warmup_steps=1", "train.grad_clip=0.5"]
EP = ["parallel.engine=fsdp", "parallel.expert_parallel=true"]
JOBS = {  # name -> (GPUs, overrides); every job trains 8 sequences a step
    "single": (1, ["train.micro_batch_size=8"]),
    "ep2": (2, EP + ["train.micro_batch_size=4"]),
    "ep2-compiled": (2, EP + ["train.micro_batch_size=4", "train.compile=true"]),
    "ep4": (4, EP + ["train.micro_batch_size=2"]),
    "ep2x2": (4, EP + ["parallel.expert_parallel_degree=2", "train.micro_batch_size=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-gpu")
    out = {}
    for name, (gpus, sets) in JOBS.items():
        if gpus > GPUS:
            continue
        cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(root / name), "--json"]
        cmd += ["--nproc-per-node", str(gpus)] if gpus > 1 else []
        for s in MOE + sets:
            cmd += ["--set", s]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        out[name] = json.loads(p.stdout)
    return out


@pytest.mark.parametrize("name", [n for n in JOBS if n != "single"])
def test_dropless_expert_parallel_matches_one_gpu(runs, name):
    if name not in runs:
        pytest.skip(f"{name} needs {JOBS[name][0]} GPUs, found {GPUS}")
    ref, run = runs["single"], runs[name]
    assert run["moe"]["dispatch"] == "dropless"
    assert run["moe"]["experts_per_rank"] == (1 if name == "ep4" else 2)
    assert run["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-4)
    assert run["history"]["grad_norm"] == pytest.approx(ref["history"]["grad_norm"], rel=1e-3)
    assert run["moe"]["tokens_per_expert_last_step"] == ref["moe"]["tokens_per_expert_last_step"]
