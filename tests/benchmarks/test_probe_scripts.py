"""The GPU probe scripts (sm_partition.py, l2_prefetch.py, merge_up_tune.py, read_ceiling.py) refuse bad arguments, a --out
outside an existing folder, and a machine without a CUDA GPU: one ``error:`` line, exit 2, nothing written."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

BENCH = ROOT / "benchmarks" / "scripts"
SCRIPTS = ("sm_partition.py", "l2_prefetch.py", "merge_up_tune.py", "read_ceiling.py")


def _run(script, *args, cwd):
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("bad", [["--reps", "0"], ["--reps", "x; rm -rf ."], ["--out", "missing/dir/x.json"],
                                 ["--out", "."]], ids=["zero", "text", "no-folder", "a-folder"])
def test_a_bad_argument_is_one_error_line_and_nothing_is_written(tmp_path, script, bad):
    args = ["--out", "r.json", *bad]
    r = _run(script, *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and r.stdout == "", (bad, r.stderr)
    error = r.stderr.strip().splitlines()[-1]
    assert bad[0] in error and "CUDA" not in error  # refused for the argument, before any GPU question
    assert list(tmp_path.iterdir()) == []


def test_sm_counts_must_be_positive_integers(tmp_path):
    for sms in ("120,abc", "120,-8", "120,,96"):
        r = _run("sm_partition.py", "--out", "r.json", "--sms", sms, cwd=tmp_path)
        assert r.returncode == 2 and "--sms" in r.stderr and r.stderr.count("error:") == 1, (sms, r.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
@pytest.mark.parametrize("script", SCRIPTS)
def test_without_a_cuda_gpu_the_probe_says_so(tmp_path, script):
    r = _run(script, "--out", "r.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("error: the probe needs a CUDA GPU")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad, says", [(["--top", "0"], "--top"), (["--top", "1; touch x"], "--top"),
                                       (["--set", "model.bogus=1"], "model.bogus")])
def test_profile_step_refuses_bad_arguments_in_one_line(tmp_path, bad, says):
    r = _run("profile_step.py", str(ROOT / "recipes" / "tiny.yaml"), *bad, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and r.stdout == "", r.stderr
    assert says in r.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
