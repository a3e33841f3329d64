"""Stopping a sweep stops everything its running point started: a two-rank train point (torchrun, gloo,
ranks in their own sessions) killed through the sweep by SIGINT, SIGTERM or SIGKILL leaves no process
behind, and rerunning the sweep completes the point."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from sweep_helpers import MARK, lines, marked, new_mark, wait_for, write_sweep

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(sys.platform != "linux", reason="subreapers and /proc are Linux")]


def _ranks(mark: str) -> list[int]:
    """Marked processes that are torchrun workers (they carry LOCAL_RANK)."""
    out = []
    for pid in marked(mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"LOCAL_RANK=") for e in env):
            out.append(pid)
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_killing_the_sweep_kills_every_rank_and_a_rerun_completes(tmp_path, sig):
    sweep = write_sweep(tmp_path / "s.yaml", {
        "set": {"parallel.engine": "ddp", "train.steps": 30, "train.measure_warmup_steps": 2},
        "nproc_per_node": 2, "modes": ["train"], "timeout_s": 600})
    out = tmp_path / "out"
    mark = new_mark()
    proc = subprocess.Popen([sys.executable, "-m", "scaletool", "sweep", str(sweep), "-o", str(out)], cwd=ROOT,
                            env={**os.environ, MARK: mark}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = wait_for(lambda: len(_ranks(mark)) >= 2 and _ranks(mark), timeout=180)
        assert ranks, f"the ranks never started: {proc.communicate(timeout=300)}"
        # the case the supervisor exists for: torchrun starts each rank in a session of its own
        assert all(os.getsid(r) != os.getsid(proc.pid) and os.getsid(r) == r for r in ranks)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), stderr
    if sig != signal.SIGKILL:
        assert f"stopped by {sig.name}" in stderr and "Traceback" not in stderr
    assert wait_for(lambda: not marked(mark), timeout=300), f"survivors: {marked(mark)}"
    assert not (out / "results.jsonl").exists()  # the interrupted run recorded nothing

    if sig == signal.SIGKILL:  # the hardest case (no handler ran); the others leave the same state behind
        res = run_cli("sweep", str(sweep), "-o", str(out), timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        (rec,) = lines(out)
        assert rec["status"] == "ok" and rec["result"]["status"] == "completed"
