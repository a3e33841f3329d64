"""Resuming without losing anything: a finished run is left alone, more steps continue it with the
earlier measurement kept, metrics.jsonl stays gap- and duplicate-free, a run is never overwritten."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from scaletool.cli import main

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
BASE = ["train.checkpoint_every=4", "train.measure_warmup_steps=1"]


def train(out: Path, *sets: str, args=("--json",)):
    cmd = ["train", TINY, "--out", str(out), *args]
    for s in (*BASE, *sets):
        cmd += ["--set", s]
    return CliRunner().invoke(main, cmd)


def rows(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def finished(tmp_path) -> Path:
    out = tmp_path / "run"
    r = train(out, "train.steps=8")
    assert r.exit_code == 0, r.stderr
    return out


def test_resuming_a_finished_run_is_a_no_op_that_says_so(finished):
    before = {p: p.read_bytes() for p in (finished / "summary.json", finished / "metrics.jsonl")}
    for flag in ("--resume", "--auto-resume"):
        r = train(finished, "train.steps=8", args=(flag,))
        assert r.exit_code == 0, r.stderr
        assert "nothing to do" in r.stderr and "already completed 8 steps" in r.stderr
        assert {p: p.read_bytes() for p in before} == before
    r = train(finished, "train.steps=8", args=("--resume", "--json"))
    assert json.loads(r.stdout)["steps_completed"] == 8 and json.loads(r.stdout)["segments"][0]["end_step"] == 8


def test_more_steps_continue_and_keep_the_earlier_measurement(finished):
    first = json.loads((finished / "summary.json").read_text())
    r = train(finished, "train.steps=16", args=("--resume", "--json"))
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["start_step"] == 8 and s["steps_completed"] == 16 and s["history"]["step"] == list(range(16))
    assert s["history"]["loss"][:8] == first["history"]["loss"]
    earlier, later = s["segments"]
    assert (earlier["start_step"], earlier["end_step"], later["start_step"], later["end_step"]) == (0, 8, 8, 16)
    assert earlier["timing"] == first["segments"][0]["timing"] and earlier["tokens_per_s"] == first["tokens_per_s"]
    assert later["resumed_from"].endswith("step_8") and s["measured_segment"] == 1
    assert s["tokens_per_s"] == later["tokens_per_s"] and s["timing"] == later["timing"]
    assert rows(finished) == list(range(16))


def test_a_resume_that_measures_nothing_keeps_the_earlier_figures(finished):
    first = json.loads((finished / "summary.json").read_text())
    r = train(finished, "train.steps=9", args=("--resume", "--json"))  # 1 step, all of it warm-up
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["segments"][1]["measured_steps"] == 0 and s["measured_segment"] == 0
    assert s["tokens_per_s"] == first["tokens_per_s"] and s["timing"] == first["timing"]
    assert s["measured_steps"] == first["measured_steps"] > 0


def test_a_run_directory_is_never_overwritten(finished):
    before = (finished / "summary.json").read_bytes()
    r = train(finished, "train.steps=8")
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {finished}: already holds a training run (summary.json, metrics.jsonl, checkpoints); resume it, "
        "or train into another directory"]
    assert (finished / "summary.json").read_bytes() == before


def test_a_resume_after_a_crash_drops_the_rows_it_retrains(finished):
    (finished / "summary.json").unlink()  # as if killed after step 8's checkpoint ...
    with (finished / "metrics.jsonl").open("a") as f:  # ... while step 9 was being logged
        f.write(json.dumps({"step": 8, "loss/train": 1.0}) + "\n" + '{"step": 9, "loss/tr')
    r = train(finished, "train.steps=12", args=("--auto-resume", "--json"))
    assert r.exit_code == 0, r.stderr
    assert rows(finished) == list(range(12))
    assert json.loads(r.stdout)["history"]["step"] == list(range(12))
