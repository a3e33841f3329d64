"""The results directory: one sweep at a time (a lock naming its holder, taken over when the holder dies),
names that never escape their root, and read-only or full disks that lose nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT, fill
from sweep_helpers import AS_MHA, lines, write_sweep

from scaletool import api
from scaletool.cli import main
from scaletool.results.sweep import SweepSummary
from scaletool.sweep.lock import LOCK_FILE, results_lock
from scaletool.sweep.store import RESULTS_FILE

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

HOLD = ("import sys, time; from pathlib import Path; from scaletool.sweep.lock import results_lock\n"
        "with results_lock(Path(sys.argv[1]), what='scaletool sweep other'):\n"
        "    print('held', flush=True); time.sleep(600)\n")


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("error: ")]


def test_a_second_sweep_on_a_locked_directory_exits_2_naming_the_holder_and_takes_over_when_it_dies(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "modes": ["estimate"]})
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out)])
        assert res.exit_code == 2 and "Traceback" not in res.output
        (line,) = _error_lines(res.output)
        assert f"in use by pid {holder.pid} on host" in line and "scaletool sweep other" in line
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written, nothing run
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without unlocking: the kernel released its flock, and the lock is simply taken
    with results_lock(out, what="me"):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(Exception, match=f"in use by pid {os.getpid()}"):
            with results_lock(out):  # a second holder, even in the same process
                pass


def test_a_name_never_leads_outside_the_results_root_and_the_api_returns_the_summary(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b" / "c" / "d"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    sweep = write_sweep(tmp_path / "s.yaml", {"name": "../../../../outside", "set": AS_MHA, "modes": ["estimate"]})
    summary = api.sweep(sweep)
    assert isinstance(summary, SweepSummary) and summary.kind == "sweep"
    assert summary.results_dir == str(Path("runs") / "sweeps" / "outside")
    assert summary.status_counts["ok"] == 1 and summary.ran_now == 1
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert all(p == "s.yaml" or p.startswith("a/b/c/d/runs/sweeps/outside/") for p in written), written
    (rec,) = lines(work / "runs" / "sweeps" / "outside")
    assert rec["sweep"] == "../../../../outside"  # the name itself is kept for reports


def _seed(out: Path) -> bytes:
    """A results directory holding one record (from a finished sweep); its bytes."""
    out.mkdir()
    rec = {"key": "old", "point_id": "p", "mode": "estimate", "sweep": "s", "index": 0, "label": "base", "status": "ok"}
    (out / RESULTS_FILE).write_text(json.dumps(rec) + "\n")
    return (out / RESULTS_FILE).read_bytes()


def test_a_read_only_results_directory_is_one_error_line(small_fs, tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "modes": ["estimate"]})
    before = _seed(small_fs / "out")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    for out in (small_fs / "out", small_fs / "new"):  # an existing results dir (resume) and a new one
        res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out)])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        (line,) = _error_lines(res.output)
        assert "Read-only file system" in line
    assert (small_fs / "out" / RESULTS_FILE).read_bytes() == before


def test_a_full_disk_is_one_error_line_and_a_rerun_resumes(small_fs, tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "zip": [{"model.intermediate_size": 128},
                                                                    {"model.intermediate_size": 256}],
                                             "modes": ["estimate"]})
    out = small_fs / "out"
    before = _seed(out)
    filler = fill(small_fs)
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = _error_lines(res.output)
    assert "No space left on device" in line and "rerun to resume" in line
    assert (out / RESULTS_FILE).read_bytes().startswith(before)  # what was recorded is still there
    filler.unlink()
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert [r["status"] for r in lines(out)[1:]] == ["ok", "ok"]
