"""Real processes, real signals: what survives ``kill -9`` and what SIGTERM leaves behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletool import api

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
ENDLESS = ["train.steps=100000", "train.log_every=1", "train.checkpoint_every=3", "train.measure_warmup_steps=1"]


def start(out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scaletool", *args[:2], "train", TINY, "--out", str(out), *args[2:]]
    for s in ENDLESS:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(proc: subprocess.Popen, metrics: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} rows in {metrics} after {timeout} s")


def steps_of(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_kill_9_leaves_every_logged_row_and_a_resume_continues_without_gaps(tmp_path):
    out = tmp_path / "run"
    proc = start(out)
    wait_for_rows(proc, out / "metrics.jsonl", 8)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rows = steps_of(out / "metrics.jsonl")
    logged = [int(line.split()[1]) for line in (out / "train.log").read_text().splitlines() if line.startswith("step ")]
    assert rows == list(range(len(rows))) and len(rows) >= 8  # flushed as written: nothing lost, no torn row
    assert logged and logged[-1] in rows
    # continue from the newest checkpoint to a few steps past the kill
    total = len(rows) + 2
    s = api.train(TINY, overrides=[*ENDLESS, f"train.steps={total}"], out=out, resume="required", quiet=True)
    assert s.start_step % 3 == 0 and s.start_step <= len(rows)
    assert steps_of(out / "metrics.jsonl") == list(range(total)) == s.history.step


def test_sigterm_stops_with_the_partial_result_delivered(tmp_path):
    out, result_file = tmp_path / "run", tmp_path / "result.json"
    proc = start(out, "--result-file", str(result_file), "--json")
    wait_for_rows(proc, out / "metrics.jsonl", 4)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    printed = json.loads(stdout)
    assert printed == json.loads(result_file.read_text()) == json.loads((out / "summary.json").read_text())
    assert printed["status"] == "failed" and printed["message"].startswith("stopped by SIGTERM after ")
    assert len(printed["history"]["step"]) >= 4 and printed["timing"]["step_s"]["n"] >= 1
    # one line says where it stopped and how to resume (tests/train/test_clean_stop.py has the rest)
    stops = [line for line in stderr.splitlines() if line.startswith("stopped by")]
    assert len(stops) == 1 and stops[0].startswith(printed["message"] + "; checkpoint ")
    assert "Traceback" not in stderr and "error:" not in stderr


def test_a_stop_inside_a_checkpoint_write_waits_for_the_write():
    """SIGTERM during dcp.save was wrapped into a CheckpointException (exit 1, a half-written checkpoint);
    now it is held until the write ends, then stops the run as any SIGTERM does."""
    from scaletool.train.trainer import Stopped, stop_on_signals, uninterrupted

    finished = []
    with stop_on_signals(), pytest.raises(Stopped, match="stopped by SIGTERM"):
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run by now; it must not have raised here
            finished.append("write")
    assert finished == ["write"]
    with stop_on_signals():  # a fresh run starts with nothing held
        with uninterrupted():
            finished.append("again")
    assert finished == ["write", "again"]
