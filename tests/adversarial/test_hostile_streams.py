"""Where output goes: a standard output that cannot take it (`> /dev/full`) is one `error:` line on stderr and
status 2, never a traceback, for every kind of output (rich tables, --json, --help); `calibrate --out` that
cannot take the calibration (a FIFO, /dev/full, a missing folder, a directory) is refused before the
measurement, which would otherwise be lost."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hostile import ROOT, invoke


@pytest.mark.parametrize("args", [["hardware"], ["estimate", "tiny", "--json"], ["estimate", "tiny"], ["--help"],
                                  ["plan", "tiny", "--gpus", "2"], ["docs", "hostile-input"]])
def test_stdout_on_dev_full_is_one_error_line(tmp_path, args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "scaletool", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["error: cannot write the output (No space left on device): standard output "
                                        "is full or closed"], proc.stderr[-2000:]


@pytest.mark.parametrize("make, expected", [
    (lambda d: (os.mkfifo(d / "fifo.yaml"), d / "fifo.yaml")[1], "not a regular file"),
    (lambda d: "/dev/full", "not a regular file"),
    (lambda d: d / "missing" / "cal.yaml", "no such directory"),
    (lambda d: d, "is a directory"),
])
def test_calibrate_out_that_cannot_take_the_file_is_refused_before_measuring(tmp_path, monkeypatch, make, expected):
    import scaletool.predict.calibrate as measuring

    def never(*a, **k):
        raise AssertionError("measured before the output path was checked")

    monkeypatch.setattr(measuring, "calibrate", never)
    out = make(tmp_path)
    lines, _ = invoke(["calibrate", "--device", "cpu", "--out", str(out)])
    assert len(lines) == 1 and "--out" in lines[0] and str(out) in lines[0] and expected in lines[0], lines
