"""A stop is one line, not a traceback: real ``scaletool train`` processes, real SIGTERM and SIGINT.

SIGTERM (a Slurm time limit, ``kill``, ``timeout``) and SIGINT (Ctrl-C) end ``scaletool train`` at the end of
a step with one line on stderr: the step it stopped after, the checkpoint a resume starts from (written then
when ``train.checkpoint_every`` is set) and the command that resumes it; exit status 143 or 130; no
traceback. Before the first step (imports, the build, the first step's compile) the stop is at once, and
the line says there is nothing to resume. Nothing here asserts a time: each test waits for rows in
``metrics.jsonl`` (or for the process to start), then signals.
"""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes that train: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
ENDLESS = ["train.steps=100000", "train.log_every=1", "train.measure_warmup_steps=1"]


def start(out: Path, *extra: str, sets: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scaletool", "train", TINY, "--out", str(out), *extra]
    for s in (*ENDLESS, *sets):
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(proc: subprocess.Popen, metrics: Path, n: int, timeout: float = 600) -> None:
    """Until ``metrics`` holds ``n`` rows (a generous guard against a hang, not a timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} rows in {metrics} after {timeout} s")


def stop(proc: subprocess.Popen, sig: int) -> tuple[str, str]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    return out, err


def stop_line(err: str) -> str:
    (line,) = [x for x in err.splitlines() if x.startswith("stopped by")]
    assert err.rstrip().splitlines()[-1] == line  # the last line the run prints
    return line


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_sigterm_stops_after_a_step_writes_the_due_checkpoint_and_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    proc = start(out, sets=("train.checkpoint_every=1000",))  # none falls due by itself before the stop
    wait_for_rows(proc, out / "metrics.jsonl", 3)
    _, err = stop(proc, signal.SIGTERM)
    line = stop_line(err)
    s = summary(out)
    n = s["steps_completed"]
    assert n >= 3 and line.startswith(f"stopped by SIGTERM after {n} of 100000 steps; ")
    assert s["status"] == "failed" and s["message"] == f"stopped by SIGTERM after {n} of 100000 steps"
    assert f"checkpoint {out / 'checkpoints' / f'step_{n}'};" in line  # the stop step, saved at the stop
    assert (out / "checkpoints" / f"step_{n}").is_dir()
    # the printed command resumes from that checkpoint (two steps more, so that the test ends)
    resume = shlex.split(line.split("; resume: ", 1)[1])
    assert resume[:3] == ["scaletool", "train", TINY] and resume[-1] == "--resume"
    again = subprocess.run([sys.executable, "-m", "scaletool", *resume[1:], "--set", f"train.steps={n + 2}", "--json"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    done = json.loads(again.stdout)
    assert done["status"] == "completed" and done["start_step"] == n and done["history"]["step"] == list(range(n + 2))


def test_sigint_is_ctrl_c_exit_130_and_without_checkpointing_says_so(tmp_path):
    out = tmp_path / "run"
    proc = start(out)  # train.checkpoint_every 0: no checkpoint is due
    wait_for_rows(proc, out / "metrics.jsonl", 2)
    _, err = stop(proc, signal.SIGINT)
    line = stop_line(err)
    n = summary(out)["steps_completed"]
    assert line.startswith(f"stopped by SIGINT after {n} of 100000 steps; no checkpoint (train.checkpoint_every is 0)")
    assert line.endswith("--auto-resume") and not (out / "checkpoints").exists()


def test_json_keeps_stdout_one_document_and_the_stop_line_on_stderr(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "--json", sets=("train.checkpoint_every=2",))
    wait_for_rows(proc, out / "metrics.jsonl", 3)
    stdout, err = stop(proc, signal.SIGTERM)
    printed = json.loads(stdout)
    assert printed == summary(out) and printed["message"].startswith("stopped by SIGTERM after ")
    assert stop_line(err).startswith(printed["message"] + "; checkpoint ")


def test_a_stop_inside_the_first_compile_is_one_line_with_nothing_to_resume(tmp_path):
    """train.compile: the first step compiles for seconds on any machine; a SIGTERM then comes out of Dynamo
    (222 lines of traceback before), now it is the one line, and nothing is lost (no step had finished)."""
    out = tmp_path / "run"
    proc = start(out, sets=("train.compile=true",))
    log = out / "train.log"
    deadline = time.monotonic() + 600  # a guard against a hang, not a timing
    while not (log.is_file() and "run directory" in log.read_text()):  # the banner: the first step starts now
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    _, err = stop(proc, signal.SIGTERM)
    line = stop_line(err)
    assert line.startswith("stopped by SIGTERM before the first step; nothing to resume: start again with scaletool "
                           "train "), line
    assert not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text()


def test_compiled_run_stops_as_cleanly(tmp_path):
    """train.compile: the signal during the first step's compile would have come out of Dynamo; after it the
    run stops at the step's end like an eager one."""
    out = tmp_path / "run"
    proc = start(out, sets=("train.compile=true", "train.checkpoint_every=1000"))
    wait_for_rows(proc, out / "metrics.jsonl", 2)
    _, err = stop(proc, signal.SIGTERM)
    n = summary(out)["steps_completed"]
    assert stop_line(err).startswith(f"stopped by SIGTERM after {n} of 100000 steps; checkpoint ")


def test_local_ranks_stop_together_and_the_parent_prints_the_one_line(tmp_path):
    """--nproc-per-node 2 (gloo): torchrun's agent passes SIGTERM to both ranks; they agree at the next log
    boundary, stop after the same step, save the checkpoint together; the parent alone prints."""
    out = tmp_path / "run"
    proc = start(out, "--nproc-per-node", "2", sets=("parallel.engine=ddp", "train.checkpoint_every=1000"))
    wait_for_rows(proc, out / "metrics.jsonl", 2)
    _, err = stop(proc, signal.SIGTERM)
    line = stop_line(err)
    s = summary(out)
    n = s["steps_completed"]
    assert line.startswith(f"stopped by SIGTERM after {n} of 100000 steps; checkpoint ")
    assert (out / "checkpoints" / f"step_{n}").is_dir() and s["message"].startswith("stopped by SIGTERM after")


def test_launch_torchrun_stops_with_the_line_and_its_own_command_resumes(tmp_path):
    """`scaletool launch torchrun`: the ranks start with --auto-resume, so the launch command itself resumes."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "scaletool", "launch", "torchrun", TINY, "--nproc-per-node", "2", "--out", str(out)]
    for s in (*ENDLESS, "parallel.engine=ddp", "train.checkpoint_every=1000"):
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(proc, out / "metrics.jsonl", 2)
    _, err = stop(proc, signal.SIGTERM)
    n = summary(out)["steps_completed"]
    line = stop_line(err)
    assert line.startswith(f"stopped by SIGTERM after {n} of 100000 steps; checkpoint {out / 'checkpoints' / f'step_{n}'}; ")
    assert shlex.split(line.split("; resume: ", 1)[1])[:3] == ["scaletool", "launch", "torchrun"]
