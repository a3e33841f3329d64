"""The sbatch script: #SBATCH lines parsed, bash syntax checked, the srun/torchrun argv split back
word by word, exports that survive shell metacharacters, and submission through a stand-in sbatch."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.cli import main
from scaletool.config import RecipeError
from scaletool.launch.commands import LaunchSpec, torchrun_argv
from scaletool.launch.slurm import SlurmOptions, render_sbatch, sbatch_argv, submit

TINY = str(RECIPES / "tiny.yaml")
NASTY = "data.path=/data/my corpus/it's $HOME;`id`.txt"


def _spec(**kw) -> LaunchSpec:
    base = dict(recipe=TINY, out="runs/slurm-test", nnodes=4, nproc_per_node=8, max_restarts=2, rdzv_timeout_s=300,
                overrides=("parallel.engine=fsdp", NASTY), python="/opt/venv/bin/python")
    base.update(kw)
    return LaunchSpec(**base)


def sbatch_directives(text: str) -> dict[str, str]:
    """``#SBATCH --key=value`` lines (before the first command, as sbatch reads them) -> {key: value}."""
    out = {}
    for line in text.splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        m = re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def srun_argv(text: str) -> list[str]:
    """The srun command with its continuation lines joined, split as the shell would split it."""
    joined = text.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if ln.startswith("srun "))
    return shlex.split(line)


def test_directives_and_torchrun_under_srun(tmp_path):
    text = render_sbatch(_spec(), SlurmOptions(time="1-02:00:00", partition="gpu", account="proj_42",
                                               exports=("NCCL_DEBUG=WARN",), workdir="/shared/work"))
    assert sbatch_directives(text) == {
        "job-name": "scaletool-tiny", "nodes": "4", "ntasks-per-node": "1", "chdir": "/shared/work",
        "gpus-per-node": "8",
        "time": "1-02:00:00", "partition": "gpu", "account": "proj_42", "output": "runs/slurm-test/slurm-%j.out"}
    argv = srun_argv(text)
    assert argv[:4] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    # shlex leaves the batch shell's own variables unexpanded: they are the endpoint and id torchrun gets.
    expected = torchrun_argv(_spec(), endpoint="${head_node}:${rdzv_port}", rdzv_id="${SLURM_JOB_ID}")
    assert argv[4:] == expected
    assert "cd /shared/work  # also when run without sbatch (bash THIS_FILE inside an allocation)" in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_cpu_nodes_and_defaults():
    text = render_sbatch(_spec(nnodes=2, nproc_per_node=2), SlurmOptions(gpus_per_node=0, cpus_per_task=16))
    d = sbatch_directives(text)
    assert "gpus-per-node" not in d and "partition" not in d and "account" not in d
    assert d["cpus-per-task"] == "16" and d["time"] == "01:00:00"


def test_exports_reach_the_environment_verbatim(tmp_path):
    """Shell metacharacters in --env values and overrides stay data: run the script's own export lines."""
    value = "a b'c\"d $(touch pwned) `touch pwned2`; $HOME"
    text = render_sbatch(_spec(), SlurmOptions(exports=(f"ODD={value}", "EMPTY=")))
    exports = "\n".join(ln for ln in text.splitlines() if ln.startswith("export "))
    res = subprocess.run(["bash", "-c", exports + '\nprintf "%s|%s" "$ODD" "$EMPTY"'], capture_output=True,
                         text=True, cwd=tmp_path, check=True)
    assert res.stdout == value + "|"
    assert not list(tmp_path.iterdir())  # nothing was executed


@pytest.mark.parametrize("opts, problem", [
    (SlurmOptions(partition="gpu\n#SBATCH --account=theirs"), "--partition"),
    (SlurmOptions(account="a b"), "--account 'a b': goes on an #SBATCH line"),
    (SlurmOptions(time="2 hours"), "--time '2 hours'"),
    (SlurmOptions(job_name="x;y"), "--job-name"),
    (SlurmOptions(workdir="/shared/my work"), "--workdir '/shared/my work'"),
    (SlurmOptions(workdir="-P"), "--workdir '-P': starts with '-'"),
    (SlurmOptions(exports=("1BAD=x",)), "--env '1BAD=x'"),
    (SlurmOptions(exports=("NOVALUE",)), "--env 'NOVALUE'"),
])
def test_bad_slurm_options(opts, problem):
    with pytest.raises(RecipeError, match=re.escape(problem)):
        render_sbatch(_spec(), opts)


def test_out_dir_with_spaces_cannot_name_the_slurm_log():
    with pytest.raises(RecipeError, match="--out \\(Slurm log path\\)"):
        render_sbatch(_spec(out="runs/with space"), SlurmOptions())


def test_site_template(tmp_path):
    t = tmp_path / "site.j2"
    t.write_text("#!/bin/bash\n#SBATCH --nodes={{ nnodes }}\nmodule load cuda\nsrun {{ torchrun | join(' ') }}\n")
    text = render_sbatch(_spec(), SlurmOptions(), template=t)
    assert "module load cuda" in text and srun_argv(text)[1:3] == ["/opt/venv/bin/python", "-m"]
    t.write_text("{{ no_such_variable }}")
    with pytest.raises(RecipeError, match="no_such_variable"):
        render_sbatch(_spec(), SlurmOptions(), template=t)


def _fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(f"#!{sys.executable}\n{body}")
    p.chmod(0o755)
    return d


def test_submit_calls_sbatch_with_an_argument_list(tmp_path, monkeypatch):
    log = tmp_path / "argv.txt"
    bin_dir = _fake_bin(tmp_path, "sbatch", f"import sys\nopen({str(log)!r}, 'w').write(repr(sys.argv[1:]))\n"
                                            "print('4242;cluster')\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "my job.sbatch"
    script.write_text("#!/bin/bash\n")
    assert submit(script) == "4242"
    assert log.read_text() == repr(sbatch_argv(script)[1:]) == repr(["--parsable", str(script)])


def test_submit_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RecipeError, match="sbatch: not found on PATH"):
        submit(tmp_path / "x.sbatch")
    bin_dir = _fake_bin(tmp_path, "sbatch", "import sys\nsys.stderr.write('sbatch: error: invalid partition\\n')\n"
                                            "sys.exit(1)\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(RecipeError, match="sbatch refused .*: sbatch: error: invalid partition"):
        submit(tmp_path / "x.sbatch")


def test_cli_writes_and_submits(tmp_path, monkeypatch):
    bin_dir = _fake_bin(tmp_path, "sbatch", "print('77')\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["launch", "slurm", TINY, "--nnodes", "2", "--set",
                                    "parallel.engine=fsdp", "--out", str(out), "--submit"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"submitted job 77: {out / 'launch.sbatch'}")
    assert sbatch_directives((out / "launch.sbatch").read_text())["nodes"] == "2"


def test_cli_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    res = CliRunner().invoke(main, ["launch", "slurm", TINY, "--nnodes", "2", "--nproc-per-node", "4",
                                    "--set", "parallel.engine=fsdp", "--out", str(tmp_path / "run"), "--dry-run",
                                    "--partition", "gpu"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("#!/bin/bash\n") and sbatch_directives(res.output)["partition"] == "gpu"
    assert not (tmp_path / "run").exists()
