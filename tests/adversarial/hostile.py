"""Shared checks of the adversarial suite: a hostile input is refused with exit status 2, one or more
`error:` lines on stderr (each short), nothing else printed, no exception other than the exit, no hang,
and nothing written.

Each test module here holds one family of inputs (recipe files, --set values, Hugging Face configs) as a
parametrised list; add a case to the list when a new way to break an input path is found.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from conftest import no_hang

from scaletool.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
# An echoed value is cut (scaletool.errors.echo): no message line needs more than this.
MAX_LINE = 400


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")} if path.exists() else set()


def assert_refused(res, *, within: Path | None = None, before: set[Path] | None = None) -> list[str]:
    """``res`` (a CliRunner result) is a clean refusal; returns its stderr lines."""
    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], res.exception)
    assert isinstance(res.exception, SystemExit), repr(res.exception)  # no traceback: the CLI exited itself
    lines = res.stderr.rstrip("\n").split("\n")
    assert lines and all(line.startswith("error: ") for line in lines), lines[:5]
    assert all(len(line) <= MAX_LINE for line in lines), max(lines, key=len)[:500]
    assert "Traceback" not in res.stderr and res.stdout == ""
    if within is not None:
        assert files_under(within) == before, sorted(files_under(within) - (before or set()))
    return lines


def invoke(args: list[str], *, within: Path | None = None) -> tuple[list[str], object]:
    """Run the CLI in-process on ``args`` and check the refusal; returns (stderr lines, result)."""
    before = files_under(within) if within is not None else None
    with no_hang():  # an input that expands without bound hangs here; the guard turns that into a failure
        res = CliRunner().invoke(main, args)
    return assert_refused(res, within=within, before=before), res


def run_scaletool(*args: str, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m scaletool ARGS`` as a real process, killed after ``timeout`` seconds (a hang fails the test)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "scaletool", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def assert_process_refused(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.rstrip("\n").split("\n")
    assert lines and all(line.startswith("error: ") for line in lines), lines[:5]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines
