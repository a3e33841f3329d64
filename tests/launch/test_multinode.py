"""Real multi-node launches on this machine: two node processes meeting at a loopback rendezvous,
each running one gloo rank of the tiny recipe. Failures are real too: kill -9 of a worker, a
rendezvous missing a node."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import RECIPES, ROOT

pytestmark = pytest.mark.distributed
TINY = str(RECIPES / "tiny.yaml")
LIMIT_S = 240  # a hang fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's launcher, as a child process with its output in files."""

    def __init__(self, argv: list[str], logs: Path, name: str, env: dict | None = None):
        self.err_path = logs / f"{name}.err"
        # CPU ranks (gloo) even on a GPU machine: two one-rank "nodes" on one host would share GPU 0.
        self.proc = subprocess.Popen(argv, stdout=open(logs / f"{name}.out", "w"), stderr=open(self.err_path, "w"),
                                     cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
                                     start_new_session=True)

    def wait(self, limit_s: float = LIMIT_S) -> int:
        try:
            return self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            pytest.fail(f"{self.err_path.stem} still running after {limit_s} s; its stderr ends:\n"
                        f"{self.stderr[-3000:]}")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error: ")]


def launch_nodes(tmp_path: Path, out: Path, *extra: str, node_ranks=(0, 1), launcher: str = "torchrun") -> list[Node]:
    port = free_port()
    argv = [sys.executable, "-m", "scaletool", "launch", launcher, TINY, "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(out), *extra]
    argv += ["--rdzv-timeout", "60"]
    return [Node(argv + (["--node-rank", str(r)] if r is not None else []), tmp_path, f"node{i}")
            for i, r in enumerate(node_ranks)]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def wait_until(ready, nodes: list[Node], what: str) -> None:
    t0 = time.monotonic()
    while not ready():
        assert all(n.proc.poll() is None for n in nodes), [n.stderr[-2000:] for n in nodes]
        assert time.monotonic() - t0 < LIMIT_S, f"never: {what}"
        time.sleep(0.02)


def worker_of(node: Node) -> psutil.Process:
    """The training rank under a node's launcher (launch is the torchrun agent itself)."""
    kids = [p for p in psutil.Process(node.proc.pid).children() if "scaletool" in " ".join(p.cmdline())]
    assert len(kids) == 1, kids
    return kids[0]


def test_two_nodes_fsdp(tmp_path):
    out = tmp_path / "run"
    nodes = launch_nodes(tmp_path, out, "--set", "parallel.engine=fsdp", "--json")
    assert [n.wait() for n in nodes] == [0, 0], [n.stderr[-3000:] for n in nodes]
    for i in range(2):  # stdout holds only the JSON: the ranks' output went to stderr
        d = json.loads((tmp_path / f"node{i}.out").read_text())
        assert d["exit_code"] == 0 and d["errors"] == [] and d["summary"]["status"] == "completed"
        assert d["argv"][d["argv"].index("--rdzv-conf") + 1] == f"join_timeout=60,read_timeout=60,is_host={1 - i}"
    s = summary(out)
    assert s["status"] == "completed" and s["engine"] == "fsdp"
    assert s["environment"]["world_size"] == 2 and s["environment"]["launched"]
    assert s["history"]["step"] == list(range(10)) and s["loss_last"] < s["loss_first"]
    assert s["elastic"] == {"restart_count": 0, "max_restarts": 0, "run_id": "scaletool-run"}
    for n in nodes:
        assert n.stderr.strip().splitlines()[-1].startswith(f"{out}: 10 steps, loss ")


def test_kill_one_worker_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    nodes = launch_nodes(tmp_path, out, "--max-restarts", "1", "--set", "parallel.engine=fsdp",
                         "--set", "train.steps=40", "--set", "train.checkpoint_every=10")
    done = out / "checkpoints" / "step_10" / "trainer.json"
    wait_until(done.exists, nodes, f"{done} written")
    worker_of(nodes[1]).kill()  # SIGKILL: no handler runs, nothing is flushed
    saved = max(int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*/trainer.json"))
    assert [n.wait() for n in nodes] == [0, 0], [n.stderr[-3000:] for n in nodes]
    s = summary(out)
    assert s["status"] == "completed" and s["steps_completed"] == 40
    assert s["start_step"] == saved and s["resumed_from"] == str(out / "checkpoints" / f"step_{saved}")
    assert s["history"]["step"] == list(range(40))  # the curve from the checkpoint, then the resumed steps
    assert s["elastic"]["restart_count"] == 1 and s["elastic"]["max_restarts"] == 1
    assert s["loss_last"] < s["loss_first"]
    assert "1 restart(s)" in nodes[0].stderr.strip().splitlines()[-1]


def test_killed_worker_without_restarts_names_the_rank_and_cause(tmp_path):
    out = tmp_path / "run"
    nodes = launch_nodes(tmp_path, out, "--set", "parallel.engine=fsdp", "--set", "train.steps=100000")
    metrics = out / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count("loss/train") >= 3, nodes, "3 steps trained")
    victim = worker_of(nodes[1])
    victim.kill()
    assert [n.wait() for n in nodes] == [1, 1]
    killed = nodes[1].error_lines()
    m = re.fullmatch(r"error: rank (\d) \(local rank 0, pid (\d+)\): killed by SIGKILL \(.*\)", killed[-1])
    assert m and int(m.group(2)) == victim.pid, killed
    peer = 1 - int(m.group(1))
    survivor = nodes[0].error_lines()[-1]  # the peer's own line, relayed by its launcher from the error file
    assert survivor.startswith(f"error: rank {peer}/2 (node "), survivor
    assert "): communication " in survivor and "gloo" in survivor
    if peer == 0:  # rank 0 survived long enough to keep the loss curve so far
        s = summary(out)
        assert s["status"] == "failed" and s["message"].startswith("communication error (gloo): ")


def test_a_hung_peer_times_out_the_collective_instead_of_hanging(tmp_path):
    out = tmp_path / "run"
    nodes = launch_nodes(tmp_path, out, "--set", "parallel.engine=fsdp", "--set", "train.steps=100000",
                         "--set", "parallel.collective_timeout_s=3")
    metrics = out / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count("loss/train") >= 3, nodes, "3 steps trained")
    hung = worker_of(nodes[1])
    hung.send_signal(signal.SIGSTOP)  # alive, holding its sockets, answering nothing
    try:
        assert nodes[0].wait() == 1
    finally:
        hung.send_signal(signal.SIGCONT)
    line = nodes[0].error_lines()[-1]
    assert re.match(r"error: rank \d/2 \(node \d, local rank 0, host .*\): communication timed out: ", line), line
    assert "parallel.collective_timeout_s" in line
    assert nodes[1].wait() != 0 and nodes[1].error_lines()  # the other node ends too, with its reason


def test_rendezvous_that_cannot_form_fails_with_one_line(tmp_path):
    port = free_port()
    node = Node([sys.executable, "-m", "scaletool", "launch", "torchrun", TINY, "--nnodes", "2", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-timeout", "3", "--rdzv-id", "lonely", "--out", str(tmp_path / "run"),
                 "--set", "parallel.engine=fsdp"], tmp_path, "node0")
    assert node.wait() == 1
    assert node.error_lines() == [f"error: rendezvous 'lonely' at 127.0.0.1:{port}: 2 nodes did not all join within "
                                  "3 s (--rdzv-timeout); start the launch on every node with the same --rdzv-endpoint "
                                  "and --rdzv-id, and check that the endpoint's port is reachable from each"]
    assert "Traceback" not in node.stderr


def test_deepspeed_launcher_two_nodes_with_a_hostfile(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    hostfile = out / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")  # as a node that started first wrote it
    with open(hostfile) as held:  # held open, its inode number cannot be taken by a new file
        nodes = launch_nodes(tmp_path, out, "--hosts", "localhost,127.0.0.1", "--set", "parallel.engine=deepspeed",
                             "--set", "parallel.zero_stage=2", launcher="deepspeed")
        assert [n.wait() for n in nodes] == [0, 0], [n.stderr[-3000:] for n in nodes]
        # Each node wrote the file anew beside it and renamed it over: never truncated in place, where a node
        # reading it while the other rewrote it saw it cut, quit, and left the other waiting for it.
        assert os.fstat(held.fileno()).st_ino != hostfile.stat().st_ino and held.read() == hostfile.read_text()
    assert hostfile.read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"
    s = summary(out)
    assert s["status"] == "completed" and s["engine"] == "deepspeed"
    assert s["environment"]["world_size"] == 2 and s["elastic"] is None  # not torchrun
    assert s["history"]["step"] == list(range(10)) and s["loss_last"] < s["loss_first"]


def test_deepspeed_launcher_with_a_node_missing_fails_within_the_timeout(tmp_path):
    """The DeepSpeed launcher has no rendezvous: a node that never starts would leave the other's rank
    waiting the group's whole timeout (30 minutes on gloo); --rdzv-timeout bounds it."""
    port = free_port()
    node = Node([sys.executable, "-m", "scaletool", "launch", "deepspeed", TINY, "--nnodes", "2", "--node-rank", "0",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "3", "--hosts", "localhost,127.0.0.1",
                 "--out", str(tmp_path / "run"), "--set", "parallel.engine=deepspeed"], tmp_path, "node0")
    assert node.wait(limit_s=60) == 1
    line, last = node.error_lines()
    assert last == "error: the DeepSpeed launcher failed (exit status 1); the failing ranks' error lines are above"
    assert "Traceback" not in node.stderr
    assert re.fullmatch(rf"error: rank 0/2 \(node 0, local rank 0, host .*\): the 2 ranks did not all join at "
                        rf"127\.0\.0\.1:{port} within 3 s \(--join-timeout; `scaletool launch deepspeed "
                        r"--rdzv-timeout`\): .*1/2 clients joined; start the launch on every node with the same "
                        r"--rdzv-endpoint and check that its port is reachable from each", line), line


# -- the sbatch script, run for real: stand-ins for srun and scontrol start its torchrun twice --------

FAKE_SRUN = """
import os, subprocess, sys, time
args = sys.argv[1:]
nodes = int(next(a.split("=")[1] for a in args if a.startswith("--nodes=")))
cmd = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
procs = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)})
         for i in range(nodes)]
while any(p.poll() is None for p in procs):
    if any(p.returncode for p in procs):  # --kill-on-bad-exit
        for p in procs:
            p.poll() is None and p.terminate()
    time.sleep(0.1)
sys.exit(max(abs(p.returncode) for p in procs))
"""


def test_sbatch_script_runs_torchrun_on_every_node(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    res = subprocess.run([sys.executable, "-m", "scaletool", "launch", "slurm", TINY, "--nnodes", "2",
                          "--nproc-per-node", "1", "--gpus-per-node", "0", "--rdzv-port", str(free_port()),
                          "--out", str(out), "--script", str(script), "--workdir", str(ROOT),
                          "--set", "parallel.engine=deepspeed", "--env", "OMP_NUM_THREADS=1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=LIMIT_S)
    assert res.returncode == 0, res.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", "print('localhost\\nlocalhost')\n")):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    job = Node(["bash", str(script)], tmp_path, "job",
               env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
                    "SLURM_JOB_NODELIST": "localhost"})
    assert job.wait() == 0, job.stderr[-3000:]
    s = summary(out)
    assert s["status"] == "completed" and s["engine"] == "deepspeed" and s["environment"]["world_size"] == 2
    assert s["elastic"]["run_id"] == "4242"  # --rdzv-id "${SLURM_JOB_ID}" expanded by the batch shell
    assert s["history"]["step"] == list(range(10))
