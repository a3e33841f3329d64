"""A node whose peers never come: `launch torchrun --node-rank 1` with no node 0 once waited 166 s (the store
client's own 60 s timeout, retried) and printed 30 C++ stack frames above its error line. Now the store's
waits are bounded by --rdzv-timeout and the node ends with the launch line and one `error:` line."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from hostile import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_a_node_without_node_0_ends_with_one_error_line_within_its_timeout(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    endpoint = f"127.0.0.1:{free_port()}"
    # the guard is the bound: three --rdzv-timeouts and the start-up, far below the 166 s it took
    proc = subprocess.run([sys.executable, "-m", "scaletool", "launch", "torchrun", "tiny", "--nnodes", "2",
                           "--node-rank", "1", "--rdzv-endpoint", endpoint, "--rdzv-timeout", "3", "--out",
                           str(tmp_path / "run"), "--set", "parallel.engine=ddp"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("launch: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: rendezvous 'scaletool-run' at {endpoint}: "), lines[:8]
    assert "frame #" not in proc.stderr and "Exception raised from" not in proc.stderr


def test_the_rendezvous_conf_bounds_the_store_by_the_timeout(tmp_path):
    from scaletool.launch.commands import LaunchSpec, torchrun_argv

    spec = LaunchSpec(recipe="tiny", out=str(tmp_path), nnodes=2, node_rank=1, rdzv_endpoint="n1:29500",
                      rdzv_timeout_s=42)
    argv = torchrun_argv(spec)
    conf = dict(kv.split("=") for kv in argv[argv.index("--rdzv-conf") + 1].split(","))
    assert conf["join_timeout"] == conf["read_timeout"] == "42"


def test_the_stderr_filter_drops_cpp_frames_and_keeps_the_rest(capfd):
    from scaletool.launch.run import cpp_noise_filtered

    with cpp_noise_filtered():
        os.write(2, b"[W1127 19:06:28.293906608 TCPStore.cpp:340] [c10d] TCP client failed - retrying\n"
                    b"Exception raised from throwTimeoutError at socket.cpp:1030 (most recent call first):\n"
                    b"frame #0: c10::Error::Error() + 0x9d\n<omitting python frames>\n\n"
                    b"a worker's own line\n[W1127 x.cpp:1] not c10d\nlast")
    err = capfd.readouterr().err
    assert err == "a worker's own line\n[W1127 x.cpp:1] not c10d\nlast", err
