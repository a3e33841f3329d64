"""Links planted in a run directory before `train --resume`: a `checkpoints` link once made the resumed run write
`step_6`, `step_8` elsewhere, and a `summary.json` link was refused only as a rank traceback after every step
had trained. Now each of the run's own names that is a link (or of the wrong kind) is one `error:` line before
any step, and the link's target is left as it was."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile import assert_refused, files_under

from scaletool.cli import main

TRAIN = ["train", "tiny", "--set", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (copied for each case)."""
    out = tmp_path_factory.mktemp("base") / "run"
    res = CliRunner().invoke(main, [*TRAIN, "--out", str(out), "--set", "train.steps=4", "--json"])
    assert res.exit_code == 0, res.output
    return out


def _plant(run: Path, elsewhere: Path, name: str) -> Path:
    """Move ``run/name`` to ``elsewhere/name`` (or create it there) and put a link to it in its place."""
    target = elsewhere / name
    if (run / name).exists():
        shutil.move(run / name, target)
    elif name in ("checkpoints", "tensorboard"):
        target.mkdir()
    else:
        target.write_text("")
    (run / name).symlink_to(target)
    return target


@pytest.mark.parametrize("name", ["checkpoints", "summary.json", "metrics.jsonl", "train.log", "tensorboard"])
@pytest.mark.parametrize("how", ["--resume", "--auto-resume"])
def test_a_link_in_place_of_a_runs_own_name_is_refused_before_any_step(tmp_path, finished, name, how):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(finished, run, symlinks=True)
    elsewhere.mkdir()
    target = _plant(run, elsewhere, name)
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in files_under(elsewhere)}
    res = CliRunner().invoke(main, [*TRAIN, "--out", str(run), "--set", "train.steps=8", how])
    lines = assert_refused(res)
    assert lines == [f"error: {run / name}: is a symbolic link; scaletool does not write its own files through links "
                     "(remove it)"], lines
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in files_under(elsewhere)} == before
    assert target.is_symlink() is False and not list(elsewhere.rglob("step_6"))


@pytest.mark.parametrize("make, name, kind", [
    (lambda run: os.mkfifo(run / "summary.json"), "summary.json", "a regular file"),
    (lambda run: (run / "checkpoints").write_text("x"), "checkpoints", "a directory"),
    (lambda run: (run / "metrics.jsonl").mkdir(), "metrics.jsonl", "a regular file"),
])
def test_a_runs_own_name_of_the_wrong_kind_is_refused_before_any_step(tmp_path, make, name, kind):
    run = tmp_path / "run"
    run.mkdir()
    make(run)
    res = CliRunner().invoke(main, [*TRAIN, "--out", str(run), "--set", "train.steps=2", "--auto-resume"])
    lines = assert_refused(res)
    assert lines == [f"error: {run / name}: not {kind}; scaletool writes its own {name} there (remove it)"], lines


def test_a_resume_without_links_continues(tmp_path, finished):
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    res = CliRunner().invoke(main, [*TRAIN, "--out", str(run), "--set", "train.steps=6", "--resume", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["steps_completed"] == 6
    assert (run / "checkpoints" / "step_6").is_dir()
