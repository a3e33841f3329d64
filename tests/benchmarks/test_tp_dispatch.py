"""benchmarks/scripts/tp_dispatch.py: one training step's DTensor dispatches under tensor parallelism, counted
on two gloo ranks (scaletool.measure.dispatch.DispatchCount), the DTensor plan against parallel.tp_local_ops.

The counts are properties of the plan (not of the device or of timing): the local form must issue the same
collectives with far fewer ops through DTensor's dispatcher, and its block count must not grow with depth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # real processes: left out of -m "not slow"

SCRIPT = ROOT / "benchmarks" / "scripts" / "tp_dispatch.py"


def run(*args: str, ranks: int | None = 2) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks else [sys.executable]
    return subprocess.run([*launch, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.distributed
def test_local_ops_issue_the_same_collectives_with_far_fewer_dtensor_dispatches(tmp_path):
    out = tmp_path / "counts.json"
    jobs = {"mha": "model.attention=mha", "mha-local": "model.attention=mha,parallel.tp_local_ops=true",
            "mla": "", "mla-local": "parallel.tp_local_ops=true",
            "mla-local-4": "parallel.tp_local_ops=true,model.n_layers=4"}
    p = run("--out", str(out), *[f"--job={k}={v}" for k, v in jobs.items()])
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["device"] == "cpu" and doc["torch"]
    c = doc["jobs"]
    for kind in ("mha", "mla"):
        plan, local = c[kind], c[f"{kind}-local"]
        assert plan["collectives_by_name"] == local["collectives_by_name"], kind
        assert plan["collectives"] > 0 and local["dtensor_ops"] * 3 < plan["dtensor_ops"], kind
        # inside the blocks no linear or norm runs on DTensors: what is left is the root's (head, final norm)
        for op in ("mm", "rsqrt", "t"):
            assert local["dtensor_ops_by_name"].get(op, 0) * 3 < plan["dtensor_ops_by_name"][op], (kind, op)
    # two more blocks add only per-parameter bookkeeping (FSDP2's detaches, a view), none of the blocks' maths
    deeper, two = c["mla-local-4"]["dtensor_ops_by_name"], c["mla-local"]["dtensor_ops_by_name"]
    grown = {op for op in deeper if deeper[op] != two.get(op, 0)}
    assert grown and grown <= {"detach", "view"}, grown


@pytest.mark.parametrize("args, message", [
    (["--out", "x.json"], "error: run under torchrun"),
    (["--out", "x.json", "--job", "nameonly"], "error: --job 'nameonly': expected NAME="),
    (["--out", "x.json", "--job", "bad=model.vocab_size=255"], "model.vocab_size: 255 columns do not split"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "RANK": "0"} if "vocab" in message else dict(os.environ))
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ") and message in p.stderr, p.stderr
    assert not (tmp_path / "x.json").exists()
