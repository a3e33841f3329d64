"""The `.deepspeed_env` files and environment variables DeepSpeed's pdsh runner turns into `export NAME=VALUE;`
in the command every host's shell runs: the name unquoted, the value in double quotes unless plain. Each
hostile case is first shown to run a command when DeepSpeed's own `add_export` builds the export and `sh -c`
runs it (so the case is a real injection, not a made-up one), then shown refused by `scaletool launch
deepspeed` before anything starts, with nothing written. Accepted files export their values literally."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hostile import invoke

from scaletool.launch.commands import MAX_ENV_FILE_BYTES, env_file_problems

DS = ["launch", "deepspeed", "tiny", "--set", "parallel.engine=deepspeed", "--nnodes", "2", "--hosts", "n1,n2",
      "--rdzv-endpoint", "n1:29500"]


def ds_export_line(path: Path) -> str:
    """What DeepSpeed's runner puts in front of the remote command for this file: its own reading loop
    (runner.main: text mode, readlines, split at the first '=') and its own ``add_export`` quoting."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    runner = object.__new__(PDSHRunner)  # add_export needs only the exports mapping
    runner.exports = {}
    with open(path) as fd:
        for var in fd.readlines():
            key, val = var.split("=", maxsplit=1)
            runner.add_export(key, val)
    return "".join(f"export {k}={v}; " for k, v in runner.exports.items())


def run_like_a_host(exports: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", exports + "env"], cwd=cwd, capture_output=True, text=True, timeout=60)


# Each runs `touch MARK` (in the shell's directory) when DeepSpeed's export line reaches a shell.
INJECTIONS = {
    "a command in the name": "A;touch${IFS}MARK;B=1\n",
    "a substitution in the name": "A$(touch MARK)=1\n",
    "a substitution in the value": "A=$(touch MARK)\n",
    "backticks in the value": "A=`touch MARK`\n",
    "a quote that closes the value's quotes": 'A=x";touch MARK;"\n',
    "a backslash escaping the closing quote": "A=x\\\nB=;touch MARK;\"\n",
    "after many harmless lines": "A=1\n" * 2000 + "B=$(touch MARK)\n",
    "after a carriage return": "A=1\rB=$(touch MARK)\n",
}


@pytest.mark.parametrize("name", INJECTIONS)
@pytest.mark.parametrize("where", ["cwd", "home"])
def test_an_env_file_that_would_run_a_command_on_every_host_is_refused(tmp_path, monkeypatch, name, where):
    shell_dir = tmp_path / "host"
    shell_dir.mkdir()
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_bytes(INJECTIONS[name].encode())
    run_like_a_host(ds_export_line(env_file), shell_dir)
    assert (shell_dir / "MARK").exists(), "not an injection: DeepSpeed's export line ran no command"

    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    (work if where == "cwd" else home).joinpath(".deepspeed_env").write_bytes(env_file.read_bytes())
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    lines, _ = invoke([*DS, "--out", str(work / "run"), "--dry-run"], within=tmp_path)
    assert any(".deepspeed_env line" in ln for ln in lines), lines
    assert not list(work.rglob("MARK")) and not (work / "run").exists()


@pytest.mark.parametrize("text, expected", [
    ("NOEQ\n", "line 1: 'NOEQ': not NAME=VALUE"),
    ("A=1\n\nB=2\n", "line 2: '': not NAME=VALUE"),
    ("A=1\nB=2\nlast", "line 3: 'last': not NAME=VALUE"),
    ("A=x\x00y\n", "line 1: holds a control character"),
    ("A=x\x1b[2Jy\n", "line 1: holds a control character"),
    ("1A=x\n", "line 1: DeepSpeed's launcher exports it to every host with its name unquoted"),
    ("A-B=x\n", "line 1: DeepSpeed's launcher exports it to every host with its name unquoted"),
    ("\u00e9=x\n", "line 1: DeepSpeed's launcher exports it to every host with its name unquoted"),
])
def test_lines_deepspeed_would_crash_on_or_paste_are_named(tmp_path, monkeypatch, text, expected):
    """A line without '=' (an empty one too) crashes DeepSpeed's runner (it unpacks a split at '='); a name
    that is not an identifier or a control character is no plain assignment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    (tmp_path / ".deepspeed_env").write_bytes(text.encode())
    if "=" not in text.splitlines()[-1] or "\n\n" in text:
        with pytest.raises(ValueError):  # DeepSpeed's own reading of the file
            ds_export_line(tmp_path / ".deepspeed_env")
    lines, _ = invoke([*DS, "--out", str(tmp_path / "run"), "--dry-run"], within=tmp_path)
    assert lines == [f"error: {tmp_path / '.deepspeed_env'} {expected}" + lines[0].split(expected, 1)[1]], lines


def test_an_oversize_env_file_is_refused_whole_not_checked_up_to_a_cutoff(tmp_path, monkeypatch):
    """300,000 harmless lines (1.2 MB) then a substitution: the file is refused, never read in part."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    path = tmp_path / ".deepspeed_env"
    path.write_text("A=1\n" * 300_000 + "B=$(touch MARK)\n")
    assert path.stat().st_size > MAX_ENV_FILE_BYTES
    lines, _ = invoke([*DS, "--out", str(tmp_path / "run"), "--dry-run"], within=tmp_path)
    assert len(lines) == 1 and "larger than 1 MiB" in lines[0], lines


@pytest.mark.parametrize("blob, expected", [
    (b"A=\xff\xfe\n", "not UTF-8 text"),
    ("".join(f"X{i}=$(x)\n" for i in range(50)).encode(), "45 more lines like these"),
])
def test_binary_and_long_lists_of_bad_lines_stay_short(tmp_path, blob, expected):
    path = tmp_path / ".deepspeed_env"
    path.write_bytes(blob)
    problems = env_file_problems(str(path))
    assert len(problems) <= 6 and expected in problems[-1], problems


def test_ds_env_file_names_the_file_and_a_link_is_followed_as_deepspeed_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    target = tmp_path / "elsewhere.env"
    target.write_text("A=$(touch MARK)\n")
    (tmp_path / "mine.env").symlink_to(target)
    monkeypatch.setenv("DS_ENV_FILE", "mine.env")
    lines, _ = invoke([*DS, "--out", str(tmp_path / "run"), "--dry-run"])
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'mine.env'} line 1: "), lines


def test_a_fifo_env_file_is_skipped_as_deepspeed_skips_it_and_nothing_waits(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    os.mkfifo(tmp_path / ".deepspeed_env")
    from click.testing import CliRunner
    from conftest import no_hang

    from scaletool.cli import main

    with no_hang(60):
        res = CliRunner().invoke(main, [*DS, "--out", str(tmp_path / "run"), "--dry-run"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("name", ["PYTHONX;touch${IFS}MARK;Y", "NCCL_$(touch MARK)", "UCX X", "PATH`touch MARK`"])
def test_an_exported_variable_whose_name_is_not_an_identifier_is_refused(tmp_path, name):
    """Names come from the environment of `scaletool launch`; `env` can set any name but '=' and NUL."""
    import os
    import sys

    env = {**os.environ, name: "1", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "scaletool", *DS, "--out", str(tmp_path / "run"), "--dry-run"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: environment variable ") and "not an identifier" in lines[0]
    assert not list(tmp_path.rglob("MARK")) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["NCCL_IB_HCA=mlx5_0,mlx5_1\n", "A = spaced value\n", "PYTHONPATH=/opt/x:/opt/y\r\n",
                                  "EMPTY=\nEQ=a=b\n", "UNICODE=caf\u00e9 na\u00efve\n"])
def test_plain_env_files_pass_and_arrive_literally(tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    path = tmp_path / ".deepspeed_env"
    path.write_bytes(text.encode())
    assert env_file_problems(str(path)) == []
    shown = run_like_a_host(ds_export_line(path), tmp_path)
    assert shown.returncode == 0
    for line in text.replace("\r\n", "\n").splitlines():
        name, _, value = line.partition("=")
        assert f"{name.strip()}={value.strip()}" in shown.stdout.splitlines()
    from click.testing import CliRunner

    from scaletool.cli import main

    res = CliRunner().invoke(main, [*DS, "--out", str(tmp_path / "run"), "--dry-run"])
    assert res.exit_code == 0, res.output
