"""Launch commands, argument by argument, and checked by the launchers' own argument parsers."""
from __future__ import annotations

import json
import shlex
import sys

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from scaletool.cli import main
from scaletool.config import RecipeError
from scaletool.launch.commands import (
    LaunchSpec,
    check_spec,
    deepspeed_argv,
    hostfile_text,
    node_env,
    read_hostfile,
    split_endpoint,
    torchrun_argv,
    train_module_args,
)
from scaletool.launch.remote import decode, encode

TINY = str(RECIPES / "tiny.yaml")
# An override whose value a shell would split, expand and unquote: it must arrive as one argument.
NASTY = "data.path=/data/my corpus/it's $HOME;rm -rf x.txt"


def _spec(**kw) -> LaunchSpec:
    base = dict(recipe=TINY, out="/shared/runs/a b", nnodes=2, nproc_per_node=4,
                overrides=("parallel.engine=fsdp", NASTY),
                rdzv_endpoint="node001:29500", rdzv_timeout_s=120, max_restarts=3, python="/opt/py/bin/python")
    base.update(kw)
    return LaunchSpec(**base)


def test_train_module_args_are_one_argument_each():
    assert train_module_args(_spec(peak_tflops=989.0)) == [
        "scaletool", "train", TINY, "--out", "/shared/runs/a b", "--auto-resume",
        "--set", "parallel.engine=fsdp", "--set", NASTY, "--peak-tflops", "989.0"]


def test_torchrun_multi_node_argv():
    argv = torchrun_argv(_spec(node_rank=1, rdzv_id="job-7"))
    assert argv == ["/opt/py/bin/python", "-m", "torch.distributed.run",
                    "--nnodes", "2", "--nproc-per-node", "4",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node001:29500", "--rdzv-id", "job-7",
                    "--rdzv-conf", "join_timeout=120,read_timeout=120,is_host=0",
                    "--max-restarts", "3", "--log-dir", "/shared/runs/a b/torchelastic",
                    "-m", *train_module_args(_spec())]


def test_torchrun_node_zero_hosts_the_store_and_default_id_follows_out():
    argv = torchrun_argv(_spec(node_rank=0))
    assert argv[argv.index("--rdzv-conf") + 1] == "join_timeout=120,read_timeout=120,is_host=1"
    assert argv[argv.index("--rdzv-id") + 1] == "scaletool-a-b"
    no_rank = torchrun_argv(_spec())
    assert no_rank[no_rank.index("--rdzv-conf") + 1] == "join_timeout=120,read_timeout=120"  # hostname decides who hosts


def test_torchrun_single_node_is_standalone():
    argv = torchrun_argv(_spec(nnodes=1, rdzv_endpoint=None, max_restarts=0))
    assert "--standalone" in argv and "--rdzv-endpoint" not in argv and "--rdzv-conf" not in argv
    assert argv[argv.index("--max-restarts") + 1] == "0"


def test_torchrun_argv_is_what_torchrun_parses():
    from torch.distributed.run import parse_args
    argv = torchrun_argv(_spec(node_rank=0))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    a = parse_args(argv[3:])
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint, a.max_restarts) == \
        ("2", "4", "c10d", "node001:29500", 3)
    assert a.rdzv_conf == "join_timeout=120,read_timeout=120,is_host=1" and a.module and not a.standalone
    assert a.training_script == "scaletool"
    assert a.training_script_args == train_module_args(_spec())[1:]


def test_deepspeed_argv_pdsh_and_no_ssh():
    spec = _spec(max_restarts=0)
    argv = deepspeed_argv(spec, "/shared/hostfile")
    assert argv == ["/opt/py/bin/python", "-m", "deepspeed.launcher.runner", "--hostfile", "/shared/hostfile",
                    "--num_nodes", "2", "--num_gpus", "4", "--master_addr", "node001", "--master_port", "29500",
                    "--no_local_rank", "--module", "scaletool.cli.remote", encode(train_module_args(spec)[1:])]
    per_node = deepspeed_argv(_spec(max_restarts=0, node_rank=1), "/shared/hostfile")
    i = per_node.index("--no_ssh")
    assert per_node[i + 1:i + 3] == ["--node_rank", "1"]


def test_the_deepspeed_launchers_ranks_bound_their_own_join():
    argv = deepspeed_argv(_spec(max_restarts=0, join_timeout_s=120), "/shared/hostfile")
    assert decode(argv[-1])[-2:] == ["--join-timeout", "120"]  # the ranks' argument: it travels over pdsh too
    assert "--join-timeout" not in train_module_args(_spec())  # torchrun's rendezvous bounds the join itself


def test_deepspeed_argv_is_what_the_deepspeed_runner_parses():
    from deepspeed.launcher.runner import parse_args
    spec = _spec(max_restarts=0, node_rank=1)
    a = parse_args(deepspeed_argv(spec, "/shared/hostfile")[3:])
    assert (a.hostfile, a.num_nodes, a.num_gpus, a.master_addr, a.master_port, a.node_rank) == \
        ("/shared/hostfile", 2, 4, "node001", 29500, 1)
    assert a.no_ssh and a.no_local_rank and a.module
    assert [a.user_script, *a.user_args] == train_module_args(spec)


def test_hostfile_written_and_checked_with_deepspeeds_parser(tmp_path):
    p, one = tmp_path / "hostfile", tmp_path / "one"
    p.write_text(hostfile_text(["node001", "node002"], 4))
    assert p.read_text() == "node001 slots=4\nnode002 slots=4\n"
    assert read_hostfile(p, _spec()) == {"node001": 4, "node002": 4}
    one.write_text(hostfile_text(["node001"], 4))
    with pytest.raises(RecipeError, match="1 host\\(s\\), but --nnodes is 2"):
        read_hostfile(one, _spec())
    with pytest.raises(RecipeError, match="node001, node002 have fewer than --nproc-per-node 8 slots"):
        read_hostfile(p, _spec(nproc_per_node=8))
    (tmp_path / "bad").write_text("node001 gpus=4\n")
    with pytest.raises(RecipeError, match="bad entry"):
        read_hostfile(tmp_path / "bad", _spec())
    with pytest.raises(RecipeError, match="--hosts"):
        hostfile_text(["node 1"], 1)


@pytest.mark.parametrize("text, problem", [
    ("node001", "expected HOST:PORT"), ("node001:0", "1-65535"), ("node001:http", "expected HOST:PORT"),
    (":29500", "expected HOST:PORT")])
def test_bad_endpoints(text, problem):
    with pytest.raises(RecipeError, match=problem):
        split_endpoint(text)


def test_ipv6_endpoint():
    assert split_endpoint("[fe80::1]:29400") == ("fe80::1", 29400)


def test_check_spec_problems_one_line_each():
    with pytest.raises(RecipeError) as e:
        check_spec(_spec(rdzv_endpoint=None, node_rank=5, rdzv_id="a b", max_restarts=2), "deepspeed")
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 4
    for part in ("--rdzv-endpoint: required with --nnodes 2", "--node-rank 5: must be in 0..1",
                 "--rdzv-id 'a b'", "--max-restarts: the DeepSpeed launcher does not restart"):
        assert part in text
    check_spec(_spec(), "torchrun")  # a good one passes


def test_node_env_fresh_store_per_attempt_for_torchrun():
    assert node_env("torchrun") == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert node_env("deepspeed") == {}


# -- the CLI's dry run --------------------------------------------------------------------------


def _dry(launcher, *args):
    return CliRunner().invoke(main, ["launch", launcher, TINY, "--dry-run", *args])


def test_dry_run_prints_the_command_it_would_run():
    res = _dry("torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "0", "--rdzv-endpoint", "node001:29500",
               "--out", "/shared/runs/a b", "--max-restarts", "3", "--rdzv-timeout", "120",
               "--set", "parallel.engine=fsdp", "--set", NASTY, "--set", "train.checkpoint_every=5")
    assert res.exit_code == 0, res.output
    words = shlex.split(res.output.strip())
    env = dict(w.split("=", 1) for w in words[:words.index(sys.executable)])
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # what the node needs, nothing of this host
    spec = _spec(node_rank=0, python=sys.executable,
                 overrides=("parallel.engine=fsdp", NASTY, "train.checkpoint_every=5"))
    assert words[words.index(sys.executable):] == torchrun_argv(spec)


def test_dry_run_json_and_deepspeed_hostfile():
    res = _dry("deepspeed", "--nnodes", "2", "--hosts", "node001,node002", "--rdzv-endpoint",
               "node001:29500", "--out", "/shared/r", "--set", "parallel.engine=deepspeed", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["launcher"] == "deepspeed" and d["hostfile"] == "/shared/r/hostfile"
    assert d["hostfile_text"] == "node001 slots=1\nnode002 slots=1\n"
    assert d["argv"][:5] == [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "/shared/r/hostfile"]


@pytest.mark.parametrize("args, line", [
    (["torchrun", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--set", "parallel.engine=fsdp"],
     "error: --out: required with --nnodes 2"),
    (["torchrun", "--nnodes", "2", "--out", "x", "--set", "parallel.engine=fsdp"], "error: --rdzv-endpoint: required"),
    # nothing was started by a dry run: the line says what the job would be
    (["torchrun", "--nproc-per-node", "2"], "error: parallel.engine: single runs one process, but this job has 2 "
                                            "ranks; use ddp, fsdp or deepspeed"),
    (["slurm", "--nnodes", "2"], "error: parallel.engine: single runs one process, but this job has 2 ranks"),
    (["deepspeed", "--max-restarts", "1", "--set", "parallel.engine=deepspeed"],
     "error: --max-restarts: the DeepSpeed launcher does not restart"),
    (["deepspeed", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--out", "x",
      "--set", "parallel.engine=deepspeed"], "error: --hostfile or --hosts: required"),
    (["torchrun", "--set", "train.stepz=3"], "did you mean 'steps'"),
    (["slurm", "--rdzv-endpoint", "h:1"], "error: no such option '--rdzv-endpoint'"),  # the allocation decides
    (["deepspeed", "--rdzv-id", "x"], "error: no such option '--rdzv-id'"),
])
def test_bad_launches_are_one_line_and_exit_2(args, line):
    res = _dry(*args)
    assert res.exit_code == 2
    assert len(res.output.splitlines()) == 1 and line in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("argv, line", [
    (["launch", TINY, "--launcher", "slurm"], f"error: '{TINY}' is not a launcher: name the launcher first, e.g. "
                                              f"`scaletool launch torchrun {TINY} ...` (launchers: torchrun, deepspeed, "
                                              "slurm); try 'scaletool launch --help'"),
    (["launch", "torchrn", TINY], "error: no launcher 'torchrn'; did you mean 'torchrun'?"),
])
def test_a_launcher_is_named_first(argv, line):
    res = CliRunner().invoke(main, argv, prog_name="scaletool")
    assert res.exit_code == 2 and len(res.output.splitlines()) == 1 and res.output.startswith(line), res.output


def test_json_dry_runs_are_typed_launch_results():
    from scaletool.results import load_result

    for launcher in ("torchrun", "deepspeed", "slurm"):
        res = _dry(launcher, "--json")
        assert res.exit_code == 0, res.output
        doc = load_result(json.loads(res.output))
        assert (doc.kind, doc.launcher, doc.dry_run) == ("launch", launcher, True)
        assert (doc.script if launcher == "slurm" else doc.argv)


def test_too_few_gpus_on_this_node_fails_before_starting(monkeypatch, tmp_path):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    res = CliRunner().invoke(main, ["launch", "torchrun", TINY, "--nproc-per-node", "2", "--set", "parallel.engine=ddp",
                                    "--out", str(tmp_path / "run")])
    assert res.exit_code == 2
    assert "error: --nproc-per-node 2: this node has 1 CUDA device(s)" in res.output
    assert not (tmp_path / "run").exists()
