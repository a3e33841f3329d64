"""The MoE benchmark driver (benchmarks/scripts/moe_layer.py) end to end on CPU through the bench runner:
the moe-tiny study times every part of the layer, trains dense and MoE on both permutation paths (each
run on the path it names) and runs expert parallelism over gloo, whose table reads the profiler's
communication share. The one- and two-GPU studies validate and name the same driver."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from test_bench_suite import bench

from scaletool.bench.study import load_study

DRIVER = ROOT / "benchmarks" / "scripts" / "moe_layer.py"
PARTS = {"router", "aux_loss", "permute/gather", "permute/indexed", "expert_gemms/fused/routed",
         "expert_gemms/three/routed", "expert_gemms/fused/aligned16", "expert_gemms/three/aligned16",
         "unpermute/gather", "unpermute/indexed", "shared_expert", "layer/eager/gather", "layer/eager/indexed"}


def test_gpu_studies_run_the_driver():
    gpu = {name: load_study(name) for name in ("moe", "moe-ep")}
    assert gpu["moe"].gpus == 1 and gpu["moe-ep"].gpus == 2
    assert {c.name for c in gpu["moe"].commands} == {"parts", "gemms", "train"}
    assert {c.name for c in gpu["moe-ep"].commands} == {"ep2", "fsdp2", "profile-ep2", "profile-fsdp2", "table"}
    ep = next(c for c in gpu["moe-ep"].commands if c.name == "ep2")
    assert "parallel.expert_parallel=true" in ep.argv and "--nproc-per-node" in ep.argv


@pytest.mark.slow  # about half a minute on a busy 2-core machine: eight processes, two of them 2-rank jobs
def test_tiny_study_runs_on_cpu(tmp_path):
    r = bench("moe-tiny", "--out", str(tmp_path), "--allow-dirty", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    parts = json.loads((tmp_path / "moe" / "parts.json").read_text())
    assert set(parts["parts"]) == PARTS and parts["tiny"] and parts["torch"] and parts["date"]
    assert all(p["ms"]["n"] == 3 and p["ms"]["p10"] <= p["ms"]["median"] <= p["ms"]["p90"] for p in parts["parts"].values())
    assert parts["config"]["rows_routed"] == parts["config"]["tokens"] * 2 <= parts["config"]["rows_aligned16"]
    gemms = json.loads((tmp_path / "moe" / "gemms.json").read_text())["gemms"]
    assert {n.rsplit("/", 1)[0] for n in gemms} == {f"{p}/{v}" for p in ("gate_up", "down")
                                                   for v in ("kn", "nk", "bmm-equal-groups", "dense-mm")}
    assert all(g["tflops"]["n"] == 3 and g["tflops"]["median"] > 0 for g in gemms.values())
    train = json.loads((tmp_path / "moe" / "train" / "train.json").read_text())
    points = train["points"]
    assert all(p["status"] == "completed" and p["tokens_per_s"]["n"] == 4 for p in points.values())
    assert (points["moe-indexed"]["permute"], points["moe-gather"]["permute"]) == ("indexed", "gather")
    assert points["dense"]["permute"] is None and points["moe-gather"]["expert_gemm"] == "loop"
    table = (tmp_path / "ep-table.md").read_text()
    assert "| ep2 | 2 |" in table and "| fsdp2 | 2 |" in table and "profile-ep2: step" in table


@pytest.mark.parametrize("args, message", [
    (["point", "sorted", "--", "train", "tiny"], "error: point takes PERMUTE (gather | indexed)"),
    (["ep-table"], "error: ep-table takes one directory"),
    (["train", "x", "--steps", "4"], "error: --steps 4 leaves fewer than 3 measured steps"),
])
def test_bad_arguments_are_one_error_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr
    assert list(tmp_path.iterdir()) == []
