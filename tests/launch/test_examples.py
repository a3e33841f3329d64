"""The ready examples in launch/: they parse, run (as dry runs) and match what scaletool generates now."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import ROOT

from scaletool.cli import main
from scaletool.launch.commands import LaunchSpec, read_hostfile
from scaletool.launch.slurm import TEMPLATE

pytestmark = pytest.mark.slow  # real processes or full training runs: left out of -m "not slow"


LAUNCH = ROOT / "launch"
# The command that wrote launch/slurm-two-node.sbatch (docs/launch.md, "Launching on clusters").
SLURM_EXAMPLE_ARGS = ["launch", "slurm", "recipes/mla-1b.yaml", "--nnodes", "2", "--nproc-per-node", "8",
                      "--partition", "gpu", "--account", "myproject", "--time", "04:00:00", "--max-restarts", "2",
                      "--out", "runs/mla-1b-2x8", "--python", "python3", "--workdir", "/path/to/scaletool",
                      "--set", "parallel.engine=fsdp", "--set", "train.checkpoint_every=100",
                      "--env", "NCCL_DEBUG=WARN", "--dry-run"]


def test_slurm_example_is_current(monkeypatch):
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(main, SLURM_EXAMPLE_ARGS)
    assert res.exit_code == 0, res.output
    assert res.output == (LAUNCH / "slurm-two-node.sbatch").read_text(), \
        "launch/slurm-two-node.sbatch is stale: regenerate it with the command in docs/launch.md"
    subprocess.run(["bash", "-n", str(LAUNCH / "slurm-two-node.sbatch")], check=True)


def test_template_in_launch_is_the_packaged_one():
    assert (LAUNCH / "slurm.sbatch.j2").resolve() == TEMPLATE.resolve()


def test_hostfile_example_fits_two_nodes_of_eight():
    spec = LaunchSpec(recipe="r.yaml", out="o", nnodes=2, nproc_per_node=8)
    assert read_hostfile(LAUNCH / "hostfile.example", spec) == {"node001": 8, "node002": 8}


def test_torchrun_two_node_script():
    script = LAUNCH / "torchrun-two-node.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {**os.environ, "HEAD": "node001", "NODE_RANK": "1", "PYTHON": sys.executable}
    res = subprocess.run([str(script), "--dry-run"], capture_output=True, text=True, env=env, cwd="/", timeout=120)
    assert res.returncode == 0, res.stderr
    words = shlex.split(res.stdout)
    argv = words[words.index(sys.executable):]
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    opts = dict(zip(argv[3:21:2], argv[4:22:2]))
    assert opts == {"--nnodes": "2", "--nproc-per-node": "8", "--rdzv-backend": "c10d",
                    "--rdzv-endpoint": "node001:29500", "--rdzv-id": "scaletool-mla-1b-2x8",
                    "--rdzv-conf": "join_timeout=900,read_timeout=900,is_host=0", "--max-restarts": "2",
                    "--log-dir": "runs/mla-1b-2x8/torchelastic", "-m": "scaletool"}
    missing = subprocess.run([str(script)], capture_output=True, text=True, env={**os.environ, "HEAD": ""})
    assert missing.returncode != 0 and "set HEAD" in missing.stderr
