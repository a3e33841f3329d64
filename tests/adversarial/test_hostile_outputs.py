"""Hostile option values and output destinations: a NaN or infinite number, ranks that are not ranks, a report
or result file that cannot be written (a device, a path under a file, a full or read-only disk). Each is one
`error:` line and exit status 2; nothing runs first, and what was written before survives whole."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import fill
from hostile import invoke

from scaletool import api
from scaletool.cli import main
from scaletool.errors import RecipeError

FIXTURE = Path(__file__).resolve().parents[1] / "report" / "fixtures" / "tiny"


@pytest.mark.parametrize("args, needle", [
    (["train", "tiny", "--peak-tflops", "nan"], "'nan' is not a finite number"),
    (["train", "tiny", "--peak-tflops", "inf"], "'inf' is not a finite number"),
    (["decode", "tiny", "--device", "cpu", "--batch", "max", "--memory-budget", "nan"], "--memory-budget"),
    (["decode", "tiny", "--device", "cpu", "--batch", "max", "--memory-budget", "inf"], "not a finite number"),
    (["launch", "torchrun", "tiny", "--peak-tflops", "Infinity", "--dry-run"], "not a finite number"),
    (["profile", "tiny", "--ranks", "a,b"], "--ranks: 'a,b': expected 'all'"),
    (["profile", "tiny", "--ranks", "0,-1"], "ranks >= 0"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v[:2] + v[-2:]))
def test_bad_numbers_and_ranks_are_refused_before_anything_runs(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    out = ["--out", str(tmp_path / "run")] if args[0] in ("train", "profile") else []
    lines, _ = invoke([*args, *out], within=tmp_path)
    assert len(lines) == 1 and needle in lines[0], lines


def test_the_api_refuses_non_finite_peaks_and_budgets(tmp_path):
    with pytest.raises(RecipeError, match="peak_tflops: expected a finite number > 0"):
        api.train("tiny", out=tmp_path / "run", peak_tflops=float("nan"))
    with pytest.raises(RecipeError, match="memory_budget_gib: expected a finite number > 0"):
        api.decode("tiny", device="cpu", batch="max", memory_budget_gib=float("inf"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["device", "under-a-file"])
def test_a_report_into_what_is_not_a_directory_is_one_line(tmp_path, where):
    target = Path("/dev/null") if where == "device" else tmp_path / "file" / "report"
    (tmp_path / "file").write_text("keep")
    lines, _ = invoke(["report", str(FIXTURE), "-o", str(target)])
    assert len(lines) == 1 and "cannot write the report" in lines[0], lines
    assert (tmp_path / "file").read_text() == "keep"


def _report_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("small_fs", ["2m"], indirect=True)
def test_a_full_or_read_only_disk_keeps_the_previous_report_whole(small_fs):
    out = small_fs / "report"
    assert CliRunner().invoke(main, ["report", str(FIXTURE), "-o", str(out)]).exit_code == 0
    before = _report_bytes(out)
    assert {"report.md", "report.html", "results.csv"} <= set(before) and any(k.startswith("plots/") for k in before)
    filler = fill(small_fs)
    lines, _ = invoke(["report", str(FIXTURE), "-o", str(out)])
    assert len(lines) == 1 and "cannot write the report: No space left on device" in lines[0], lines
    assert _report_bytes(out) == before  # not one file cut short, and no temporary file left behind
    filler.unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    lines, _ = invoke(["report", str(FIXTURE), "-o", str(out)])
    assert len(lines) == 1 and "Read-only file system" in lines[0], lines
    assert _report_bytes(out) == before


def test_a_result_file_that_cannot_be_written_loses_nothing_from_stdout(small_fs):
    target = small_fs / "estimate.json"
    ok = CliRunner().invoke(main, ["--result-file", str(target), "estimate", "tiny", "--json"])
    assert ok.exit_code == 0 and json.loads(target.read_text()) == json.loads(ok.stdout)
    before = target.read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    res = CliRunner().invoke(main, ["--result-file", str(target), "estimate", "tiny", "--json"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.splitlines() == [f"error: --result-file {target}: cannot write: Read-only file system"]
    assert json.loads(res.stdout) == json.loads(ok.stdout)  # the result still reached stdout, whole
    assert target.read_bytes() == before
