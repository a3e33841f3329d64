"""Links, FIFOs and devices planted where scaletool writes its own files (a sweep's lock, sweep.json,
results.jsonl, a run's point directories, a report's files): refused with one line naming the path, and
the file the link points to is left exactly as it was. A path the user names (--result-file, -o) is
followed, like a shell redirection; a FIFO there that nobody reads is an error, not a wait forever."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import unpacked_fixture
from hostile import RECIPES, invoke

from scaletool.fmt import LINK_REFUSED, NOT_REGULAR, open_state, write_atomic

REPORT_FIXTURE = unpacked_fixture("tiny")
VICTIM = "precious data\n"


def _sweep(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(RECIPES / "tiny.yaml"), "modes": ["estimate"],
                                    "grid": {"model.n_layers": [1, 2]}}))
    return path


@pytest.mark.parametrize("name", [".lock", "sweep.json", "results.jsonl"])
def test_a_link_planted_in_a_sweep_results_directory_is_refused_and_its_target_untouched(tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    lines, _ = invoke(["sweep", str(_sweep(tmp_path)), "-o", str(out)])
    assert lines == [f"error: {out / name}: {LINK_REFUSED}"]
    assert victim.read_text() == VICTIM and (out / name).is_symlink()


@pytest.mark.parametrize("name", ["sweep.json", "results.jsonl", ".lock"])
def test_a_fifo_planted_in_a_sweep_results_directory_is_refused_without_waiting(tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / name)
    lines, _ = invoke(["sweep", str(_sweep(tmp_path)), "-o", str(out)])
    assert len(lines) == 1 and lines[0].startswith(f"error: {out / name}: "), lines
    assert NOT_REGULAR in lines[0] or "not a regular file" in lines[0]


def test_a_linked_points_directory_is_refused_before_anything_is_removed(tmp_path):
    """A run's directory is cleaned before the run: through a planted link that would delete elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    (elsewhere / "keep" / "file").write_text(VICTIM)
    out = tmp_path / "out"
    out.mkdir()
    (out / "points").symlink_to(elsewhere)
    lines, _ = invoke(["sweep", str(_sweep(tmp_path)), "-o", str(out)])
    assert len(lines) == 1 and lines[0].startswith(f"error: {out / 'points'}: {LINK_REFUSED}"), lines
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["file", "keep"]


@pytest.mark.parametrize("name", ["report.md", "report.html", "results.csv", "plots"])
def test_a_link_planted_in_a_report_directory_is_refused_and_its_target_untouched(tmp_path, name):
    results = tmp_path / "res"
    shutil.copytree(REPORT_FIXTURE, results)
    victim = tmp_path / "victim"
    if name == "plots":
        victim.mkdir()
    else:
        victim.write_text(VICTIM)
    out = tmp_path / "report"
    out.mkdir()
    (out / name).symlink_to(victim)
    lines, _ = invoke(["report", str(results), "-o", str(out)])
    assert len(lines) == 1 and lines[0].endswith(f"{name}: {LINK_REFUSED}"), lines
    assert (victim.read_text() == VICTIM) if name != "plots" else list(victim.iterdir()) == []


def test_a_planted_temporary_file_link_is_never_written_through(tmp_path):
    """write_atomic's temporary name is predictable (pid): a link there is removed, not followed."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    target = tmp_path / "summary.json"
    (tmp_path / f".summary.json.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(target, "{}\n")
    assert target.read_text() == "{}\n" and victim.read_text() == VICTIM


def test_run_state_files_open_without_following_links(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        open_state(tmp_path / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with pytest.raises(OSError, match="not a regular file"):
        open_state("/dev/null", os.O_WRONLY)
    assert victim.read_text() == VICTIM


def test_a_link_planted_as_a_train_runs_metrics_file_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").symlink_to(victim)
    lines, _ = invoke(["train", "tiny", "--set", "train.steps=1", "--out", str(out)])
    assert len(lines) == 1 and f"{out / 'train.log'}: {LINK_REFUSED}" in lines[0], lines
    assert victim.read_text() == VICTIM


def test_a_user_named_result_file_behind_a_link_is_followed(tmp_path):
    """--result-file is the user's own path: the link stays and the file it names gets the result."""
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    from click.testing import CliRunner

    from scaletool.cli import main
    res = CliRunner().invoke(main, ["--result-file", str(tmp_path / "link.json"), "estimate", "tiny"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "link.json").is_symlink() and "params" in json.loads(target.read_text())


def test_a_result_file_fifo_nobody_reads_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    lines, res = invoke(["--result-file", str(fifo), "estimate", "tiny"])
    assert lines == [f"error: --result-file {fifo}: cannot write: a FIFO that no process is reading; start the "
                     "reader first"]
    assert fifo.exists() and not fifo.is_file()


def test_a_result_file_fifo_with_a_reader_gets_the_result(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        from click.testing import CliRunner

        from scaletool.cli import main
        res = CliRunner().invoke(main, ["--result-file", str(fifo), "estimate", "tiny"])
        assert res.exit_code == 0, res.output
        data = b""
        while chunk := os.read(reader, 1 << 16):
            data += chunk
        assert "params" in json.loads(data)
    finally:
        os.close(reader)
