"""The runner with real subprocesses: failures are recorded and the sweep goes on; resume after a kill."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import RECIPES, ROOT, run_cli

from scaletool.sweep.runner import classify
from scaletool.sweep.store import RESULTS_FILE

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

AS_MHA = {"model.attention": "mha", "model.kv_lora_rank": 0, "model.qk_nope_head_dim": None,
          "model.qk_rope_head_dim": None, "model.v_head_dim": None}


def _write(tmp_path: Path, spec: dict) -> Path:
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump({"recipe": str(RECIPES / "tiny.yaml"), **spec}, sort_keys=False))
    return p


def _lines(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / RESULTS_FILE).read_text().splitlines()]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _sweep_process(sweep: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scaletool", "sweep", str(sweep), "-o", str(out), "--json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(sys.platform != "linux", reason="finds the point's process through /proc")
def test_raising_and_killed_points_are_recorded_and_the_rest_continue(tmp_path):
    sweep = _write(tmp_path, {
        "zip": [{"train.lr": 1.0e30, "train.grad_clip": 0, "train.steps": 4},   # diverges: the run raises
                {"train.steps": 100000, "train.seed": 8},                      # killed with SIGKILL below
                {"train.steps": 3}],                                           # fine
        "set": {"train.warmup_steps": 0, "train.measure_warmup_steps": 1},
        "modes": ["train"], "timeout_s": {"train": 600}})
    out = tmp_path / "results"
    proc = _sweep_process(sweep, out)
    deadline = time.monotonic() + 300
    killed = None
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        for supervisor in _children(proc.pid):
            if "seed=8" in _cmdline(supervisor) and _children(supervisor):
                time.sleep(1.0)  # let it get going: the kill lands in the middle of training
                killed = _children(supervisor)[0]  # the point's own process, under its supervisor
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=300)
    assert killed is not None and proc.returncode == 0, stderr
    recs = _lines(out)
    assert [r["label"] for r in recs] == ["lr=1e+30 grad_clip=0 steps=4", "steps=100000 seed=8", "steps=3"]
    assert [r["status"] for r in recs] == ["error", "error", "ok"]
    assert "loss is nan" in recs[0]["error"]
    assert recs[0]["result"]["status"] != "completed"  # the partial summary train wrote is kept
    assert recs[1]["error"].startswith("killed by SIGKILL") and recs[1]["returncode"] == -signal.SIGKILL
    assert recs[2]["result"]["measured_steps"] == 2 and recs[2]["result"]["tokens_per_s"] > 0
    for r in recs:  # every run left its logs and recipe
        run_dir = out / r["run_dir"]
        assert (run_dir / "stderr.log").is_file() and (run_dir.parent / "recipe.yaml").is_file()
    summary = json.loads(stdout)
    assert summary["status_counts"] == {"ok": 1, "skipped": 0, "oom": 0, "timeout": 0, "error": 2}

    # nothing left to do on a plain rerun; --retry-failed would redo exactly the two failures
    res = run_cli("sweep", str(sweep), "-o", str(out), "--dry-run", "--json", timeout=300)
    runs = json.loads(res.stdout)["runs"]
    assert [r["will_run"] for r in runs] == [False] * 3
    res = run_cli("sweep", str(sweep), "-o", str(out), "--dry-run", "--json", "--retry-failed", timeout=300)
    assert [r["will_run"] for r in json.loads(res.stdout)["runs"]] == [True, True, False]


def test_a_run_that_outlives_its_timeout_is_stopped_and_recorded(tmp_path):
    """100000 steps never fit in 5 s, however busy the machine: the run is stopped and the next one starts."""
    sweep = _write(tmp_path, {"set": AS_MHA, "zip": [{"train.steps": 100000}, {"train.steps": 100001}],
                              "modes": ["train"], "timeout_s": 5})
    out = tmp_path / "results"
    res = run_cli("sweep", str(sweep), "-o", str(out), "--json", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = _lines(out)
    assert [r["status"] for r in recs] == ["timeout", "timeout"]
    assert all(r["error"].startswith("exceeded timeout of 5 s") and 5 <= r["wall_s"] < 5 + 30 for r in recs)


def test_resume_after_killing_the_sweep_loses_and_duplicates_nothing(tmp_path):
    sweep = _write(tmp_path, {"set": AS_MHA, "grid": {"model.intermediate_size": [64, 128, 192],
                                                      "model.n_layers": [1, 2]},
                              "modes": ["estimate"]})
    out = tmp_path / "results"
    proc = _sweep_process(sweep, out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (out / RESULTS_FILE).exists() and len((out / RESULTS_FILE).read_bytes().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=300)
    before = _lines(out)  # every line parses: no torn write
    assert 3 <= len(before) < 6

    res = run_cli("sweep", str(sweep), "-o", str(out), "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["ran_now"] == 6 - len(before)
    after = _lines(out)
    assert after[:len(before)] == before
    keys = [r["key"] for r in after]
    assert len(keys) == len(set(keys)) == 6
    assert {r["status"] for r in after} == {"ok"}
    planned = json.loads(run_cli("sweep", str(sweep), "-o", str(out), "--dry-run", "--json").stdout)["runs"]
    assert {r["key"] for r in planned} == set(keys) and not any(r["will_run"] for r in planned)


@pytest.mark.parametrize("rc,stderr,status", [
    (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    (1, "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB", "oom"),
    (2, "error: parallel.zero_stage: only used by engine=deepspeed, but parallel.engine=single", "skipped"),
    (2, "Usage: scaletool count [OPTIONS] RECIPE\nError: No such option: --bogus", "error"),
    (-9, "", "error"),
    (0, "", "error"),  # exit 0 without a result file is not a result
])
def test_classify(rc, stderr, status):
    got, why = classify(rc, False, 10, None, stderr)
    assert got == status and why
