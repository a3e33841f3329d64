"""A sweep as a Slurm job array, with stand-ins for sbatch and squeue: the script, its tasks run for real
(bash, one SLURM_ARRAY_TASK_ID at a time), resubmission of only what is missing, a changed sweep refused."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from sweep_helpers import AS_MHA, lines, write_sweep

from scaletool.cli import main
from scaletool.sweep.slurm import SLURM_DIR, SUBMISSIONS, array_spec

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"


SQUEUE_OUT = "squeue.out"  # what the squeue stand-in prints


def _directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", text, re.MULTILINE))


def _command(text: str) -> list[str]:
    """The exec line with its continuations joined, split as bash would (variables left as written)."""
    joined = text.replace("\\\n", " ")
    return shlex.split(next(ln for ln in joined.splitlines() if ln.startswith("exec ")))[1:]


def _fake_slurm(tmp_path: Path, monkeypatch) -> Path:
    """sbatch prints job 77 (and keeps the script it got); squeue prints the file SQUEUE_OUT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", f"import sys, shutil; shutil.copy(sys.argv[-1], {str(tmp_path / 'got.sbatch')!r}); "
                                  "print('77;cluster')\n"),
                       ("squeue", f"import sys; print(open({str(tmp_path / SQUEUE_OUT)!r}).read())\n")):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    (tmp_path / SQUEUE_OUT).write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def _sweep(tmp_path: Path) -> Path:
    return write_sweep(tmp_path / "s.yaml", {"set": AS_MHA, "modes": ["estimate"], "timeout_s": 120,
                                            "zip": [{"model.intermediate_size": 128}, {"model.intermediate_size": 192},
                                                    {"model.intermediate_size": 256},
                                                    {"model.n_heads": 3}]})  # invalid (64 is not divisible by 3): no job


def test_array_spec_compresses_indices():
    assert array_spec([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    assert array_spec([3], throttle=2) == "3%2"


def test_dry_run_prints_the_array_script_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["sweep", str(_sweep(tmp_path)), "-o", str(out), "--submit", "slurm", "--dry-run",
                                    "--partition", "cpu", "--parallel", "2", "--set", "train.seed=3"])
    assert res.exit_code == 0, res.output
    script = res.output
    d = _directives(script)
    assert d["array"] == "0-2%2" and d["partition"] == "cpu" and d["time"] == "12"  # 120 s + 10 min slack
    assert d["output"] == f"{out.resolve()}/{SLURM_DIR}/%A_%a.out" and "gpus-per-node" not in d
    cmd = _command(script)
    assert cmd[:5] == [sys.executable, "-m", "scaletool", "sweep", str(tmp_path / "s.yaml")]
    assert cmd[cmd.index("--set") + 1] == "train.seed=3" and cmd[cmd.index("--only-task") + 1] == "${SLURM_ARRAY_TASK_ID}"
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert not out.exists()


def test_submitted_tasks_record_their_runs_and_a_rerun_submits_only_what_is_missing(tmp_path, monkeypatch):
    _fake_slurm(tmp_path, monkeypatch)
    sweep, out = _sweep(tmp_path), tmp_path / "out"
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--submit", "slurm", "--json"])
    assert res.exit_code == 0, res.output
    sub = json.loads(res.output[res.output.index("{"):])
    assert sub["job_id"] == "77" and sub["tasks"] == [0, 1, 2]
    script = Path(sub["script"]).read_text()
    assert script == (tmp_path / "got.sbatch").read_text() and _directives(script)["array"] == "0-2"
    (entry,) = [json.loads(x) for x in (out / SLURM_DIR / SUBMISSIONS).read_text().splitlines()]
    assert entry["job_id"] == "77" and list(entry["tasks"]) == ["0", "1", "2"]
    assert [r["status"] for r in lines(out)] == ["skipped"]  # the invalid point, recorded by the submitter

    # Slurm runs task 1; tasks 0 and 2 are still queued (squeue lists pending ranges unexpanded at times)
    env = {**os.environ, "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "1"}
    done = subprocess.run(["bash", sub["script"]], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    recs = lines(out)
    assert [(r["label"], r["status"], r.get("slurm_job")) for r in recs[1:]] == [("intermediate_size=192", "ok", "77_1")]
    (tmp_path / SQUEUE_OUT).write_text("77_0\n77_[2]\n12_1\n")
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--submit", "slurm"])
    assert res.exit_code == 0 and "nothing to submit" in res.output, res.output

    # tasks 0 and 2 left the queue without a record (a node failure, a time limit): submitted again
    (tmp_path / SQUEUE_OUT).write_text("12_0\n")
    res = CliRunner().invoke(main, ["sweep", str(sweep), "-o", str(out), "--submit", "slurm", "--dry-run"])
    assert res.exit_code == 0 and _directives(res.output)["array"] == "0,2", res.output

    # an array task whose sweep changed after submission refuses to run anything
    sweep.write_text(sweep.read_text().replace("intermediate_size: 256", "intermediate_size: 320"))
    env = {**os.environ, "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "2"}
    done = subprocess.run(["bash", sub["script"]], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "plan changed since it was submitted" in done.stderr
    assert len(lines(out)) == 2


def test_option_mistakes_are_one_error_line_each(tmp_path):
    sweep = str(_sweep(tmp_path))
    out = ["-o", str(tmp_path / "out")]
    for args, needle in ((["--partition", "gpu"], "--partition: only with --submit slurm"),
                         (["--submit", "slurm", "--gpus", "0"], "--gpus: Slurm allocates each array task's GPUs"),
                         (["--submit", "slurm", "--dry-run", "--time", "soon"], "--time 'soon': expected minutes"),
                         (["--submit", "slurm", "--dry-run", "--partition", "gpu\n#SBATCH --x=y"], "goes on an #SBATCH"),
                         (["--only-task", "0"], "--only-task needs --plan-digest")):
        res = CliRunner().invoke(main, ["sweep", sweep, *out, *args])
        assert res.exit_code == 2 and "Traceback" not in res.output, (args, res.output)
        errors = [ln for ln in res.output.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0], (args, res.output)
    assert not (tmp_path / "out").exists()
