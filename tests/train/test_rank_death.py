"""A rank of ``train --nproc-per-node 2`` dies: one line per failed rank, root cause first, the partial
result in ``--json``, no traceback. A real two-rank gloo job whose rank 1 is killed with SIGKILL, and
the ordering rule on torchrun's own failure records."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from scaletool.launch.failures import child_failure_lines

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")


def test_the_killed_rank_comes_before_the_rank_that_lost_it(tmp_path):
    """The surviving rank writes its error file (and timestamp) before the agent notices the dead one."""
    err = tmp_path / "e.json"
    err.write_text(json.dumps({"message": {
        "message": "error: rank 0/2 (node 0, local rank 0, host h): communication error (gloo): Connection reset by "
                   "peer (a peer rank failed or was killed: see its line)", "extraInfo": {"timestamp": "100"}}}))
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(err)),
                1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))}
    failures[1].timestamp = 101
    lines = child_failure_lines(ChildFailedError("scaletool", failures))
    assert lines[0].startswith("error: rank 1 (local rank 1, pid 11): killed by SIGKILL")
    assert lines[1].startswith("error: rank 0/2") and len(lines) == 2


def test_the_killed_rank_comes_before_the_rank_the_agent_stopped_after_it(tmp_path):
    """The agent stops the survivors with SIGTERM; one stamped in the same second as the death is no cause."""
    err = tmp_path / "e.json"
    err.write_text(json.dumps({"message": {
        "message": "error: rank 0/2 (node 0, local rank 0, host h): Stopped: stopped by SIGTERM",
        "extraInfo": {"timestamp": "100"}}}))
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(err)),
                1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))}
    failures[1].timestamp = 100
    lines = child_failure_lines(ChildFailedError("scaletool", failures))
    assert lines[0].startswith("error: rank 1 (local rank 1, pid 11): killed by SIGKILL")
    assert lines[1].endswith("Stopped: stopped by SIGTERM") and len(lines) == 2


def test_the_killed_rank_comes_before_a_rank_that_stopped_cleanly_on_the_agents_sigterm(tmp_path):
    """A survivor that ends its step on the agent's SIGTERM exits 143 with no error file: a consequence, said so."""
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=128 + signal.SIGTERM, error_file=str(tmp_path / "a")),
                1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "b"))}
    failures[0].timestamp, failures[1].timestamp = 100, 101
    lines = child_failure_lines(ChildFailedError("scaletool", failures))
    assert lines[0].startswith("error: rank 1 (local rank 1, pid 11): killed by SIGKILL")
    assert lines[1] == "error: rank 0 (local rank 0, pid 10): stopped by SIGTERM (exit status 143)" and len(lines) == 2


def test_the_killed_rank_comes_before_a_rank_the_agents_sigterm_killed(tmp_path):
    """A survivor that the agent's SIGTERM reaches after its trainer returned (while it reports the peer's
    failure) dies of the signal, stamped in the same second as the death: a consequence, not the cause."""
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "a")),
                1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "b"))}
    failures[0].timestamp = failures[1].timestamp = 100
    lines = child_failure_lines(ChildFailedError("scaletool", failures))
    assert lines[0].startswith("error: rank 1 (local rank 1, pid 11): killed by SIGKILL")
    assert lines[1] == "error: rank 0 (local rank 0, pid 10): killed by SIGTERM" and len(lines) == 2


def test_ranks_all_killed_by_sigterm_name_the_earliest_first(tmp_path):
    """A scheduler's SIGTERM to every rank: no other cause, so the earliest is first."""
    failures = {r: ProcessFailure(local_rank=r, pid=10 + r, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "x"))
                for r in (0, 1)}
    failures[0].timestamp, failures[1].timestamp = 101, 100
    lines = child_failure_lines(ChildFailedError("scaletool", failures))
    assert lines == ["error: rank 1 (local rank 1, pid 11): killed by SIGTERM",
                     "error: rank 0 (local rank 0, pid 10): killed by SIGTERM"]


def _pids_with(marker: str, rank: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"SCALETOOL_TEST_MARK={marker}".encode() in env and f"RANK={rank}".encode() in env:
            found.append(int(d.name))
    return found


@pytest.mark.distributed
def test_rank_death_gives_per_rank_lines_root_cause_first_and_the_partial_result(tmp_path):
    out, marker = tmp_path / "run", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), "--json", "--nproc-per-node", "2",
           "--set", "parallel.engine=ddp", "--set", "train.steps=100000", "--set", "train.measure_warmup_steps=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SCALETOOL_TEST_MARK": marker})
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    victims = _pids_with(marker, "1")
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1
    s = json.loads(stdout)
    assert s["status"] == "failed" and s["failures"][0] == s["message"]
    assert s["message"].startswith(f"rank 1 (local rank 1, pid {victims[0]}): killed by SIGKILL")
    assert len(s["history"]["step"]) >= 3 and s["kind"] == "train"  # what rank 0 measured before
    assert json.loads((out / "summary.json").read_text())["failures"] == s["failures"]
    tail = stderr.strip().splitlines()[-len(s["failures"]):]
    assert tail == [f"error: {line}" for line in s["failures"]]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
