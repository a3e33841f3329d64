"""What the contention probe reads from /proc (`/proc/pressure/cpu`, `/proc/stat`, each thread's `schedstat`):
garbage, a value past 64 bits, a counter that runs backwards or an unreadable file is no reading (None), never
an exception, and a training run whose probe meets it finishes with its summary."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from scaletool.cli import main
from scaletool.measure import contention

GARBAGE = ["", "\x00\xff", "some", "some total=", "some total=-5", "some total=1e9", "some total=" + "9" * 400,
           "some avg10=nan total=1", "some avg10=inf", "cpu ", "cpu a b c d e f g h", "cpu 1 2",
           "cpu " + " ".join(["9" * 400] * 10), "cpu -1 -2 -3 -4 -5 -6 -7 -8", "x" * 100_000]


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_is_no_reading(text):
    total, avg = contention.psi_some_total_us(text), contention.psi_some_avg10(text)
    assert total is None or (isinstance(total, int) and 0 <= total < 2**64)
    assert avg is None or 0 <= avg <= 100
    jiffies = contention.cpu_jiffies(text)
    assert jiffies is None or all(isinstance(x, int) and x >= 0 for x in jiffies)


def test_counters_that_run_backwards_are_no_share():
    a = contention.Snapshot(0.0, 0.0, 10**9, 10**9, (10**6, 10**5))
    b = contention.Snapshot(1.0, 0.5, 0, 0, (10**6 + 1000, 0))
    out = contention.interval(a, b, 1)
    assert out["run_delay_share"] is None and out["psi_some_share"] is None and out["steal_share"] is None


def test_an_unreadable_or_missing_proc_file_is_none(tmp_path):
    assert contention._read(str(tmp_path / "missing")) is None
    assert contention._read(str(tmp_path)) is None  # a directory
    assert contention.run_delay_ns(str(tmp_path / "no-tasks")) is None


@pytest.mark.parametrize("how", ["garbage", "raises"])
def test_a_run_whose_probe_meets_garbage_keeps_its_summary(tmp_path, monkeypatch, how):
    def read(path):
        if how == "raises":
            raise RuntimeError("a probe that fails in a way nobody foresaw")
        return "cpu x y\nsome total=zz avg10=nan\n" if "pressure" in path or path.endswith("stat") else "a b c"

    monkeypatch.setattr(contention, "_read", read)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "tiny", "--out", str(out), "--set", "train.steps=3", "--json"])
    assert res.exit_code == 0, (res.output[-2000:], res.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 3
