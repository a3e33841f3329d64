"""Failure lines: the cause recognised from real exception types, the worker-side handler in a real
process (stderr line, exit status, torchrun's error file as torch reads it), the launcher-side lines."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from scaletool.launch.failures import child_failure_lines, describe, rank_label, rendezvous_failure_line

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

GLOO_RESET = ("\n[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:60045: Connection reset by peer. This is typically caused by a remote worker hanging "
              "or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")


@pytest.mark.parametrize("exc, starts", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"),
     "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (RuntimeError("CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported"),
     "missing GPU: local rank 3 needs its own GPU, but this node shows 0 CUDA device(s) (CUDA_VISIBLE_DEVICES=0,1)"),
    (RuntimeError(GLOO_RESET), "communication error (gloo): Read error [127.0.0.1]:60045: Connection reset by peer. ("),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
     "communication error (NCCL): NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv "
                  "operation to complete"),
     "communication timed out: Timed out waiting 5000ms for recv operation to complete ("),
    (dist.DistStoreError("Timed out after 601 seconds waiting for clients. 1/2 clients joined."),
     "communication timed out: Timed out after 601 seconds waiting for clients."),
    (ValueError("something else"), "ValueError: something else"),
])
def test_causes(exc, starts):
    text = describe(exc, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert text.startswith(starts), text
    assert "\n" not in text and "GLHF" not in text


def test_rank_label_torchrun_and_deepspeed_env():
    assert rank_label({"RANK": "5", "WORLD_SIZE": "16", "GROUP_RANK": "1", "LOCAL_RANK": "1"}).startswith(
        "rank 5/16 (node 1, local rank 1, host ")
    assert rank_label({"RANK": "2", "WORLD_SIZE": "4", "CROSS_RANK": "1", "LOCAL_RANK": "0"}).startswith(
        "rank 2/4 (node 1, local rank 0, host ")


WORKER = """
import torch
from scaletool.launch.failures import reported_failures
with reported_failures():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
"""


def _worker(tmp_path, error_file: bool):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0"}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / "error.json")
    return subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, env=env, timeout=120)


def test_worker_failure_line_exit_status_and_error_file(tmp_path):
    res = _worker(tmp_path, error_file=True)
    assert res.returncode == 1
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1/2 (node 1, local rank 0, host ")
    assert "): out of memory: CUDA out of memory. Tried to allocate 20.00 GiB (lower train.micro_batch_size" in line
    assert line.endswith(f"[traceback in {tmp_path / 'error.json'}]")
    assert "Traceback" not in res.stderr  # the traceback went to the error file
    # torch's own reader of error files (what torchrun's agent uses) finds our line and the traceback
    f = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error.json"))
    assert f.message["message"] == line.rsplit(" [traceback in ", 1)[0]
    stack = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    assert "OutOfMemoryError" in stack


def test_worker_failure_without_a_launcher_keeps_the_traceback_on_stderr(tmp_path):
    res = _worker(tmp_path, error_file=False)
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: rank 1/2 (node 1, local rank 0, host ")


def test_launcher_lines_root_cause_first(tmp_path):
    err_file = tmp_path / "e.json"
    err_file.write_text(json.dumps({"message": {"message": "error: rank 3/4 (node 1, local rank 1, host h): out of "
                                                           "memory: x", "extraInfo": {"timestamp": "100"}}}))
    failures = {
        2: ProcessFailure(local_rank=0, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json")),
        3: ProcessFailure(local_rank=1, pid=12, exitcode=1, error_file=str(err_file)),
        0: ProcessFailure(local_rank=0, pid=13, exitcode=7, error_file=str(tmp_path / "none.json")),
    }
    failures[3].timestamp, failures[2].timestamp, failures[0].timestamp = 100, 200, 300
    lines = child_failure_lines(ChildFailedError("scaletool", failures))
    assert lines == [
        "error: rank 3/4 (node 1, local rank 1, host h): out of memory: x",
        "error: rank 0 (local rank 0, pid 13): exited with status 7; its output is above",
        "error: rank 2 (local rank 0, pid 11): killed by SIGKILL (killed from outside: the host's OOM killer, a "
        "scheduler or a user)",
    ]


def test_rendezvous_lines():
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError
    line = rendezvous_failure_line(RendezvousTimeoutError(), "node001:29500", "job-1", 4, 60)
    assert line.startswith("error: rendezvous 'job-1' at node001:29500: 4 nodes did not all join within 60 s")
    assert "closed by another node" in rendezvous_failure_line(RendezvousClosedError(), "h:1", "j", 2, 5)


def test_a_store_port_in_use_is_its_own_line_not_a_join_timeout(monkeypatch):
    """Under the DeepSpeed launcher rank 0 hosts the group's store: a port another job holds is said as such,
    at once, not after the join timeout as 'did not all join'."""
    import socket
    from datetime import timedelta

    from scaletool.engines.dist import join_store
    from scaletool.errors import JoinError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(JoinError) as e:
            join_store(0, 2, 60, timedelta(seconds=60))
    assert describe(e.value) == (f"rank 0 cannot host the group's store at 127.0.0.1:{port}: the port is in use on "
                                 "this host (another job?); pick another port in --rdzv-endpoint")
