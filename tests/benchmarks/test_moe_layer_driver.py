"""benchmarks/scripts/moe_layer.py train: --points, --accum and --weight-cast reach the runs it starts, and bad
values are refused with one ``error:`` line, exit 2, nothing written (the driver at toy sizes on the CPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "scripts" / "moe_layer.py"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), "train", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


@pytest.mark.parametrize("bad, says", [(["--accum", "0"], "--accum"), (["--accum", "2; rm -rf ."], "--accum"),
                                       (["--points", "dense,moe-bogus"], "--points"),
                                       (["--weight-cast", "step"], "--weight-cast")])
def test_bad_values_are_one_error_line_and_nothing_is_written(tmp_path, bad, says):
    r = _run("out", "--tiny", *bad, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and r.stdout == "", r.stderr
    assert says in r.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_the_points_asked_for_run_with_their_accumulation(tmp_path):
    r = _run(str(tmp_path / "out"), "--tiny", "--points", "moe-gather", "--accum", "2", "--steps", "6", "--warmup", "2",
             cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "train.json").read_text())
    assert list(result["points"]) == ["moe-gather"] and result["accum"] == 2
    run = json.loads((tmp_path / "out" / "moe-gather.json").read_text())
    assert run["status"] == "completed" and run["tokens_per_step"] == 2 * run["recipe"]["train"]["micro_batch_size"] * \
        run["recipe"]["train"]["seq_len"]
    assert "2 micro-batch(es) a step" in (tmp_path / "out" / "table.md").read_text()
