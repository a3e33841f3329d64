"""Hostile option values and output destinations: a NaN or infinite number, ranks that are not ranks, a report
or result file that cannot be written (a device, a path under a file, a full or read-only disk). Each is one
`error:` line and exit status 2; nothing runs first, and what was written before survives whole."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import fill, unpacked_fixture
from hostile import invoke

from scaletool import api
from scaletool.cli import main
from scaletool.errors import RecipeError

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"

FIXTURE = unpacked_fixture("tiny")


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


# -- where a launch writes: the run directory, the batch script, the hostfile ----------------------------


@pytest.mark.parametrize("args", [
    ["launch", "torchrun", "tiny"],
    ["launch", "deepspeed", "tiny", "--set", "parallel.engine=deepspeed"],
    ["launch", "slurm", "tiny"],
    ["train", "tiny", "--nproc-per-node", "2", "--set", "parallel.engine=ddp"],
], ids=lambda a: " ".join(a[:2]))
@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, small_fs, args, where):
    (small_fs / "file").write_text("x")
    out = small_fs / "file" / "run" if where == "under-a-file" else small_fs / "run"
    if where == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    lines, _ = invoke([*args, "--out", str(out)], within=small_fs)
    reason = "Not a directory" if where == "under-a-file" else "Read-only file system"
    what = "the batch script" if args[1] == "slurm" else "the run directory"
    assert len(lines) == 1 and lines[0].endswith(f": cannot write {what} ({reason})"), lines


def test_a_sweep_submission_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    lines, _ = invoke(["sweep", "quickstart", "--submit", "slurm", "--out", str(tmp_path / "file" / "res")],
                      within=tmp_path)
    assert len(lines) == 1 and "Not a directory" in lines[0], lines


def _device_like(tmp_path: Path, name: str, major: int, minor: int) -> Path:
    """A character device of our own (as /dev/null or /dev/full), made with mknod: root only."""
    path = tmp_path / name
    if subprocess.run(["mknod", "-m", "666", str(path), "c", str(major), str(minor)]).returncode != 0:
        pytest.skip("mknod needs root: devices as outputs untested")
    return path


def test_a_result_file_on_a_device_or_fifo_is_written_into_never_replaced(tmp_path):
    """--result-file /dev/stdout (or a FIFO a script reads) is written into. Renaming a temporary file over
    it, as root can, would put a regular file where the device was: the next `> /dev/null` fills a disk."""
    null, full = _device_like(tmp_path, "null", 1, 3), _device_like(tmp_path, "full", 1, 7)
    ok = CliRunner().invoke(main, ["--result-file", str(null), "estimate", "tiny"])
    assert ok.exit_code == 0, ok.output
    assert null.is_char_device() and not list(tmp_path.glob(".null*"))
    res = CliRunner().invoke(main, ["--result-file", str(full), "estimate", "tiny"])
    assert res.exit_code == 2 and res.stderr.splitlines() == [
        f"error: --result-file {full}: cannot write: No space left on device"]
    assert full.is_char_device()
    lines, _ = invoke(["launch", "slurm", "tiny", "--script", str(full), "--out", str(tmp_path / "run")])
    assert lines == [f"error: {full}: cannot write the batch script (No space left on device)"]
    assert full.is_char_device()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    ok = CliRunner().invoke(main, ["--result-file", str(fifo), "estimate", "tiny", "--json"])
    assert ok.exit_code == 0 and json.loads(reader.communicate(timeout=300)[0]) == json.loads(ok.stdout)
    assert fifo.is_fifo()


def test_a_result_file_behind_a_symlink_replaces_the_file_and_keeps_the_link(tmp_path):
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "estimate.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    ok = CliRunner().invoke(main, ["--result-file", str(link), "estimate", "tiny", "--json"])
    assert ok.exit_code == 0 and link.is_symlink() and json.loads(target.read_text()) == json.loads(ok.stdout)


HOSTFILES = {
    "bad entry": ("node001 gpus=4\n", "Hostfile contains a bad entry: node001 gpus=4"),
    "repeated host": ("a slots=1\na slots=1\n", "multiple entries for a"),
    "no host": ("# nothing\n\n", "Hostfile is empty"),
    "shell in a name": ("a;touch${IFS}pwned slots=1\n", "'a;touch${IFS}pwned' is not a host name"),
    "a huge name": ("x" * 100_000 + " slots=1\n", "xxx' is not a host name"),
    "binary": (bytes(range(128, 256)) * 8, "not text"),
    "too big": ("n slots=1\n" + "#\n" * 600_000, "1200010 bytes; a hostfile holds"),
}


@pytest.mark.parametrize("name", HOSTFILES)
def test_a_hostile_hostfile_is_one_line_and_launches_nothing(tmp_path, monkeypatch, name):
    text, needle = HOSTFILES[name]
    hostfile = tmp_path / "hostfile"
    hostfile.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.chdir(tmp_path)
    lines, _ = invoke(["launch", "deepspeed", "tiny", "--hostfile", str(hostfile), "--out", str(tmp_path / "run"),
                       "--set", "parallel.engine=deepspeed"])
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "pwned").exists() and not list((tmp_path / "run").glob("*.log"))


def test_a_bad_hostfile_in_a_real_process_prints_one_line_and_not_deepspeeds_dump(tmp_path):
    """In a process of its own DeepSpeed's first import makes its log handler on the real stdout: neither its
    accelerator notice nor its ERROR dump of the whole file may reach stdout or stderr."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node001 slots=1\nroot:x:0:0:root:/root:/bin/bash\n")
    proc = subprocess.run([sys.executable, "-m", "scaletool", "launch", "deepspeed", "tiny", "--hostfile",
                           str(hostfile), "--out", str(tmp_path / "run"), "--set", "parallel.engine=deepspeed"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: --hostfile {hostfile}: Hostfile contains a bad entry: "
                                        "root:x:0:0:root:/root:/bin/bash, unable to proceed with launching"]


@pytest.mark.parametrize("launcher, python, needle", [
    ("deepspeed", "/nonexistent/python", "not an executable on this node"),
    ("deepspeed", "/etc/passwd", "not an executable on this node"),
    ("deepspeed", "/tmp", "not an executable on this node"),
    ("torchrun", "/bin/true", "torchrun runs in this process"),  # it would have been ignored
])
def test_a_python_that_cannot_run_here_is_refused_before_anything_starts(tmp_path, launcher, python, needle):
    lines, _ = invoke(["launch", launcher, "tiny", "--python", python, "--out", str(tmp_path / "run")],
                      within=tmp_path)
    assert len(lines) == 1 and lines[0].startswith(f"error: --python {python}: {needle}"), lines


def test_a_hostfile_and_hosts_together_are_refused(tmp_path):
    (tmp_path / "hostfile").write_text("a slots=1\n")
    lines, _ = invoke(["launch", "deepspeed", "tiny", "--hostfile", str(tmp_path / "hostfile"), "--hosts", "b,c",
                       "--dry-run"])
    assert lines == ["error: --hostfile and --hosts: give one (--hosts writes <out>/hostfile)"]


@pytest.mark.parametrize("path, needle", [("/dev/zero", "not a regular file"), ("/nonexistent/h", "no such file")])
def test_a_hostfile_that_is_not_a_file_is_one_line(tmp_path, path, needle):
    lines, _ = invoke(["launch", "deepspeed", "tiny", "--hostfile", path, "--out", str(tmp_path / "run")])
    assert lines == [f"error: --hostfile {path}: {needle}"]
