"""Two trainings into one run directory at once: the second is refused with one line naming the first
(the directory's lock, as sweeps lock theirs), whether started by `train` or by a one-node `launch`; the
lock dies with its holder."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from hostile import ROOT, invoke

HOLD = ("import sys, time; from pathlib import Path; from scaletool.sweep.lock import run_lock\n"
        "with run_lock(Path(sys.argv[1]), 'scaletool train first.yaml'):\n"
        "    print('held', flush=True); time.sleep(600)\n")


@pytest.fixture
def held(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield out, holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("args", [
    ["train", "tiny"],
    ["train", "tiny", "--resume"],
    ["train", "tiny", "--auto-resume"],
    ["train", "tiny", "--nproc-per-node", "2", "--set", "parallel.engine=ddp"],
    ["launch", "torchrun", "tiny"],
])
def test_a_second_training_into_a_locked_run_directory_is_one_line(held, args):
    out, holder = held
    lines, _ = invoke([*args, "--out", str(out)], within=out)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {out}: in use by pid {holder.pid} on host ")
    assert "(scaletool train first.yaml)" in lines[0] and lines[0].endswith("train into another directory (--out)")


def test_the_lock_dies_with_its_holder_and_a_refused_run_leaves_no_directory(tmp_path, held):
    out, holder = held
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    from click.testing import CliRunner

    from scaletool.cli import main
    res = CliRunner().invoke(main, ["train", "tiny", "--out", str(out), "--set", "train.steps=2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["status"] == "completed"
    fresh = tmp_path / "fresh"
    invoke(["train", "tiny", "--out", str(fresh), "--resume"])  # nothing to resume: refused
    assert not fresh.exists()
