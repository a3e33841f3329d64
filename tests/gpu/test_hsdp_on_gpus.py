"""HSDP and the calibration across nodes on real GPUs (NCCL): skipped below four GPUs.

- HSDP 2 × 2 (``parallel.data_parallel_replicate=2`` on 4 GPUs), eager and compiled, and HSDP 2 × 1 × TP 2, train
  the one-GPU run's loss curve (same seed, 8 sequences per step) to float32 summation-order noise.
- ``scaletool calibrate`` under two torchrun "nodes" of two GPUs each on this host (CUDA_VISIBLE_DEVICES splits
  the cards): the path a real multi-node calibration takes, with NCCL; the file it writes loads.

    python -m pytest tests/gpu/test_hsdp_on_gpus.py -q -rs      # about 2 minutes on 4 GPUs
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from scaletool.analytic.calibration import load_calibration

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(GPUS < 4, reason=f"needs 4 CUDA GPUs, found {GPUS}")]

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
COMMON = ["train.steps=4", "train.measure_warmup_steps=1"]
HSDP = ["parallel.engine=fsdp", "parallel.data_parallel_replicate=2", "train.micro_batch_size=2"]


def train(out: Path, sets: list[str], gpus: int) -> dict:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", "--nproc-per-node", str(gpus)]
    for s in COMMON + sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_hsdp_2x2_matches_one_gpu(tmp_path, compiled):
    mode = [f"train.compile={'true' if compiled else 'false'}"]
    one = train(tmp_path / "single", ["train.micro_batch_size=8", *mode], 1)
    hsdp = train(tmp_path / "hsdp", HSDP + mode, 4)
    assert hsdp["environment"]["world_size"] == 4 and hsdp["environment"]["backend"] == "nccl"
    assert hsdp["history"]["loss"] == pytest.approx(one["history"]["loss"], rel=1e-4)
    assert hsdp["history"]["grad_norm"] == pytest.approx(one["history"]["grad_norm"], rel=1e-3)


def test_hsdp_by_tensor_parallel_matches_one_gpu(tmp_path):
    """HSDP × TP on 4 GPUs: 2 replicas × 1-rank shard groups × 2 tensor-parallel ranks (a 3-D mesh), 4 sequences a
    data-parallel rank, against one GPU at 8."""
    one = train(tmp_path / "single", ["train.micro_batch_size=8"], 1)
    s = train(tmp_path / "hsdp-tp", [*HSDP[:2], "parallel.tensor_parallel=2", "train.micro_batch_size=4"], 4)
    assert s["environment"]["world_size"] == 4 and s["recipe"]["parallel"]["tensor_parallel"] == 2
    assert s["history"]["loss"] == pytest.approx(one["history"]["loss"], rel=1e-4)
    assert s["history"]["grad_norm"] == pytest.approx(one["history"]["grad_norm"], rel=1e-3)


def test_calibrate_across_two_local_nodes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "cluster.yaml"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "scaletool", "calibrate", "--out", str(out), "--message-mib", "16",
                               "--message-mib", "64"],
                              cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": devices},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, devices in ((0, "0,1"), (1, "2,3"))]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    raw = yaml.safe_load(out.read_text())
    assert raw["collectives"]["inter_node_source"].startswith("measured nccl: all_reduce over 2 nodes")
    assert load_calibration(str(out)).collectives["inter_node_gb_s"] > 0
