"""``scaletool calibrate`` across nodes on the CPU: two torchrun "nodes" of two gloo ranks each on this machine
(static rendezvous on localhost) measure the collectives inside each node and across them (one rank per node);
rank 0 writes a calibration whose inter-node bus bandwidth is the measured one, which the step-time model then
uses across nodes. Misuse is one error line."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import yaml
from conftest import run_cli

from scaletool.analytic.calibration import load_calibration
from scaletool.analytic.step import predict_step
from scaletool.config import load_recipe
from scaletool.errors import RecipeError
from scaletool.predict.calibrate_comm import REPS, job_layout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_local_nodes_measure_inside_and_across(tmp_path):
    port, out = _free_port(), tmp_path / "cluster.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "scaletool", "calibrate", "--device", "cpu", "--out", str(out),
                               "--message-mib", "0.25", "--message-mib", "1"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert "wrote" in results[0][0]  # the node of rank 0 reports; the other node's ranks print nothing
    raw = yaml.safe_load(out.read_text())
    m, c = raw["measured"], raw["collectives"]
    assert m["nodes"] == 2 and m["per_node"] == 2 and m["command"].startswith("torchrun --nnodes 2 --nproc-per-node 2")
    rail = m["collectives_inter_node"]["all_reduce"]["2"]
    assert rail["bus_gb_s"]["n"] == REPS and set(rail["by_message"]) == {str(1 << 18), str(1 << 20)}
    assert c["inter_node_gb_s"] == rail["bus_gb_s"]["median"] > 0
    assert c["inter_node_source"].startswith("measured gloo: all_reduce over 2 nodes, one rank per node")
    assert m["collectives_world"]["all_reduce"]["4"]["bus_gb_s"]["n"] == REPS  # the whole job, for comparison
    assert c["source"] == "measured gloo inside each of 2 nodes of 2 ranks"
    cal = load_calibration(str(out))
    pred = predict_step(load_recipe("tiny", ["parallel.engine=fsdp"]), cal, world_size=4, gpus_per_node=2)
    assert any("measured gloo: all_reduce over 2 nodes" in a for a in pred["assumptions"])


def test_job_layout_reads_torchrun_and_refuses_what_is_not_whole_nodes():
    assert job_layout({}) is None and job_layout({"WORLD_SIZE": "1"}) is None
    assert job_layout({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (3, 4, 1, 2)
    with pytest.raises(RecipeError, match="not whole nodes"):
        job_layout({"WORLD_SIZE": "6", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(RecipeError, match="start a calibration across nodes with torchrun"):
        job_layout({"WORLD_SIZE": "4", "RANK": "x"})


@pytest.mark.parametrize("args, says", [
    (["--device", "cpu", "--message-mib", "1"], "no collectives on one process"),
    (["--device", "cpu", "--gpus", "2", "--message-mib", "nan"], "not a finite number"),
    (["--device", "cpu", "--gpus", "2", "--message-mib", "0"], "'--message-mib'"),
    (["--device", "cpu", "--gpus", "2", "--message-mib", "0.00001"], "at least 64 bytes"),
])
def test_message_sizes_bad_input_is_one_error_line(tmp_path, args, says):
    res = run_cli("calibrate", *args, "--out", str(tmp_path / "c.yaml"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], res.stderr
    assert not (tmp_path / "c.yaml").exists()
