"""Hostile strings on the launchers' way to a shell: endpoints, hosts, run directories, recipe paths and
--set values that would run a command if a shell read them unquoted. DeepSpeed's pdsh runner is the one
launcher that hands a command to a (remote) shell; the stand-ins in standins/ (pdsh, ssh) really run what
they are given through `sh -c` on this machine, so an injection would create its marker file."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import RECIPES, ROOT, invoke

from scaletool.cli import main
from scaletool.launch.remote import decode, encode

STANDINS = Path(__file__).with_name("standins")
DS = ["launch", "deepspeed", "tiny", "--set", "parallel.engine=deepspeed", "--nnodes", "2", "--hosts", "n1,n2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENDPOINTS = {
    "command after a semicolon": "a;touch MARK;true:29500",
    "command substitution": "$(touch MARK):29500",
    "backticks": "`touch MARK`:29500",
    "pipe": "a|touch MARK:29500",
    "ampersand": "a&touch${IFS}MARK:29500",
    "redirect": "a>MARK:29500",
    "newline": "a\ntouch MARK:29500",
    "an ssh option": "-oProxyCommand=touch:29500",
    "quotes": "a'b\"c:29500",
    "a bad zone": "fe80::1%$(touch MARK):29500",
    "bracketed junk": "[a;b]:29500",
    "empty host": ":29500",
    "port zero": "a:0",
    "port too big": "a:65536",
    "unicode digits": "a:２９５００",
    "port with a command": "a:29500;touch MARK",
    "a label too long": "a" * 64 + ":29500",
}


@pytest.mark.parametrize("name", ENDPOINTS)
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_an_endpoint_that_is_not_host_and_port_is_refused_even_in_a_dry_run(tmp_path, monkeypatch, name, launcher):
    monkeypatch.chdir(tmp_path)
    args = DS if launcher == "deepspeed" else ["launch", "torchrun", "tiny", "--set", "parallel.engine=ddp",
                                               "--nnodes", "2"]
    lines, _ = invoke([*args, "--rdzv-endpoint", ENDPOINTS[name], "--out", str(tmp_path / "run"), "--dry-run"],
                      within=tmp_path)
    assert len(lines) == 1 and lines[0].startswith("error: --rdzv-endpoint "), lines
    assert not (tmp_path / "MARK").exists()


@pytest.mark.parametrize("endpoint", ["node001:29500", "10.0.0.1:29500", "[fe80::1%eth0]:29500", "::1:29500",
                                      "n_1.cluster.local.:1", "NODE-7:65535"])
def test_hosts_and_addresses_are_accepted(tmp_path, monkeypatch, endpoint):
    monkeypatch.chdir(tmp_path)
    from click.testing import CliRunner

    res = CliRunner().invoke(main, [*DS, "--rdzv-endpoint", endpoint, "--out", str(tmp_path / "run"), "--dry-run",
                                    "--json"])
    assert res.exit_code == 0, res.output
    argv = json.loads(res.stdout)["argv"]
    assert argv[argv.index("--master_addr") + 1] == endpoint.rpartition(":")[0].strip("[]")


@pytest.mark.parametrize("hosts", ["a,-oProxyCommand", "a,b;touch", "a,$(touch MARK)", "a,b c", "a,", "a,..",
                                   "a,x" + "y" * 300])
def test_hosts_that_are_not_host_names_are_refused(tmp_path, monkeypatch, hosts):
    monkeypatch.chdir(tmp_path)
    lines, _ = invoke(["launch", "deepspeed", "tiny", "--set", "parallel.engine=deepspeed", "--nnodes", "2",
                       "--hosts", hosts, "--rdzv-endpoint", "a:29500", "--out", str(tmp_path / "run"), "--dry-run"],
                      within=tmp_path)
    assert len(lines) == 1 and lines[0].startswith("error: --hosts: expected comma-separated hosts"), lines


def test_the_remote_command_carries_user_strings_as_one_inert_word(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from click.testing import CliRunner

    hostile = ["--set", "data.path=$(touch MARK)`touch MARK`\"'; touch MARK", "--out", str(tmp_path / "r $(touch M)")]
    res = CliRunner().invoke(main, [*DS, "--rdzv-endpoint", "n1:29500", *hostile, "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    argv = json.loads(res.stdout)["argv"]
    i = argv.index("scaletool.cli.remote")
    assert argv[i + 1:] == [argv[-1]] and set(argv[-1]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                               "0123456789-_=")
    args = decode(argv[-1])
    assert args[:2] == ["train", "tiny"] and hostile[1] in args and hostile[3] in args
    res = CliRunner().invoke(main, [*DS, "--rdzv-endpoint", "n1:29500", *hostile, "--dry-run"])
    assert "# every rank runs: scaletool train tiny" in res.stdout  # what the word says, for a reader


@pytest.mark.parametrize("word", ["", "!!!", encode(["a"])[:-3], "eyJhIjogMX0=", "WzEsIDJd", "é"])
def test_the_remote_module_refuses_a_word_that_is_not_an_argument_list(word):
    proc = subprocess.run([sys.executable, "-m", "scaletool.cli.remote", word], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: scaletool.cli.remote: not an encoded argument list"), proc.stderr


def test_what_pdsh_would_paste_unquoted_is_refused(tmp_path, monkeypatch):
    """The working directory and the Python go into the remote command unquoted; exported variables and
    .deepspeed_env lines in double quotes: each is refused with a line naming it."""
    odd = tmp_path / "d$(touch MARK)"
    odd.mkdir()
    monkeypatch.chdir(odd)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONWARNINGS", "ignore`touch MARK`")
    monkeypatch.setenv("NCCL_DEBUG", "$(touch MARK)")
    monkeypatch.setenv("UNRELATED", "$(fine: not exported)")
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5\nFOO=\"$(touch MARK)\"\n")
    lines, _ = invoke([*DS, "--rdzv-endpoint", "n1:29500", "--out", str(tmp_path / "run"), "--dry-run"],
                      within=tmp_path)
    assert len(lines) == 4, lines
    assert lines[0].startswith("error: the current directory '") and "d$(touch MARK)': DeepSpeed's pdsh runner puts it" \
        " unquoted" in lines[0]
    assert lines[1].startswith("error: environment variable NCCL_DEBUG: DeepSpeed's pdsh runner exports it")
    assert lines[2].startswith("error: environment variable PYTHONWARNINGS: ")
    assert lines[3].startswith(f"error: {tmp_path / '.deepspeed_env'} line 2: ")
    assert not list(tmp_path.rglob("MARK"))


@pytest.mark.parametrize("python", ["/tmp/py thon", "/tmp/py;touch MARK"])
def test_a_python_path_pdsh_would_split_is_refused(tmp_path, monkeypatch, python):
    monkeypatch.chdir(tmp_path)
    lines, _ = invoke([*DS, "--rdzv-endpoint", "n1:29500", "--out", str(tmp_path / "run"), "--python", python,
                       "--dry-run"], within=tmp_path)
    assert lines == [f"error: --python {python!r}: DeepSpeed's pdsh runner puts it unquoted into the command every "
                     "host's shell runs; name a Python whose path has letters, digits and _@%+=:,./- only"]


def test_one_node_and_node_rank_launches_keep_plain_arguments(tmp_path, monkeypatch):
    """No shell there (the runner starts the ranks with an argument list): the arguments stay readable."""
    monkeypatch.chdir(tmp_path)
    from click.testing import CliRunner

    res = CliRunner().invoke(main, [*DS, "--rdzv-endpoint", "n1:29500", "--node-rank", "1", "--set",
                                    "data.path=$(x)", "--out", str(tmp_path / "run"), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    argv = json.loads(res.stdout)["argv"]
    assert "scaletool.cli.remote" not in argv and "data.path=$(x)" in argv and "--no_ssh" in argv


@pytest.mark.distributed
def test_a_real_pdsh_launch_runs_the_training_and_no_injected_command(tmp_path):
    """Two "hosts" (localhost, 127.0.0.1) reached through the stand-in pdsh, which runs the remote command
    through `sh -c` as each host's shell would: the run completes in the literal directory and with the
    literal recipe path, and none of the substitutions in them ran."""
    bin_dir = tmp_path / "bin"
    shutil.copytree(STANDINS, bin_dir)
    log = tmp_path / "standin.log"
    recipe = tmp_path / "re$(touch MARK)`touch MARK`.yaml"
    shutil.copy(RECIPES / "tiny.yaml", recipe)
    out = tmp_path / "run $(touch MARK) ;touch MARK"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STANDIN_LOG": str(log),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "scaletool", "launch", "deepspeed", str(recipe), "--nnodes", "2",
                           "--hosts", "localhost,127.0.0.1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                           "--out", str(out), "--set", "parallel.engine=deepspeed", "--set", "train.steps=2",
                           "--rdzv-timeout", "60", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("MARK"))
    remote = [ln for ln in log.read_text().splitlines() if "deepspeed.launcher.launch" in ln]
    assert len(remote) == 1 and "scaletool.cli.remote" in remote[0] and "$(" not in remote[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["environment"]["world_size"] == 2
    assert json.loads(proc.stdout)["exit_code"] == 0
