"""``scaletool launch``: start ``scaletool train`` on one node or many (torchrun, DeepSpeed, Slurm)."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import click

from scaletool.cli.options import emit_json, json_option, recipe_argument, set_option
from scaletool.config import RecipeError, load_recipe
from scaletool.launch.commands import (
    LaunchSpec,
    check_spec,
    deepspeed_argv,
    hostfile_text,
    node_env,
    read_hostfile,
    thread_env,
    torchrun_argv,
)


def _dry_run_line(env: dict[str, str], argv: list[str]) -> str:
    """``NAME=VALUE ... python -m ...``: one line a shell runs as is."""
    return shlex.join([f"{k}={v}" for k, v in env.items()] + argv)


def _check_local_gpus(nproc_per_node: int) -> None:
    """Ranks on this node each take a GPU when CUDA is present: fail before starting if too few."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc_per_node:
        raise RecipeError(f"--nproc-per-node {nproc_per_node}: this node has {torch.cuda.device_count()} CUDA "
                          "device(s), one per rank is needed (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def _verdict(out: Path, started: float, outcome, as_json: bool, launcher: str, argv: list[str]) -> None:
    """Report the run from summary.json (rank 0 writes it) and exit with the right status."""
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() and path.stat().st_mtime >= started else None
    errors = list(outcome.errors)
    code = outcome.exit_code
    if code == 0 and summary is not None and summary.get("status") != "completed":
        errors.append(f"error: {summary.get('message') or summary.get('status')}")
        code = 1
    if as_json:
        emit_json({"launcher": launcher, "argv": argv, "exit_code": code, "errors": errors, "out_dir": str(out),
                   "summary": summary})
    for line in errors:
        click.echo(line, err=True)
    if code == 0:
        if summary is None:
            click.echo(f"this node's ranks finished; rank 0 writes {path} on its node", err=True)
        else:
            restarts = (summary.get("elastic") or {}).get("restart_count")
            click.echo(f"{out}: {summary['steps_completed']} steps, loss {summary['loss_first']:.4g} -> "
                       f"{summary['loss_last']:.4g}" + (f", {restarts} restart(s)" if restarts else ""), err=True)
    sys.exit(code)


@click.command(context_settings={"show_default": True})
@recipe_argument
@set_option
@click.option("--nnodes", type=click.IntRange(min=1), help="Nodes in the job [default: parallel.nnodes, 1].")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Ranks per node, one per GPU [default: "
              "parallel.nproc_per_node, 1].")
@click.option("--node-rank", type=click.IntRange(min=0), help="This node's index. torchrun: 0 hosts the rendezvous "
              "store (otherwise the node whose hostname matches the endpoint does); DeepSpeed: run this node's "
              "ranks only (no ssh), start launch on every node.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Where the nodes meet (the first node's address); "
              "required with --nnodes > 1 for torchrun and deepspeed. DeepSpeed: the master address and port.")
@click.option("--rdzv-id", help="Rendezvous id, the same on every node [default: scaletool-<out dir name>].")
@click.option("--rdzv-timeout", "rdzv_timeout_s", type=click.IntRange(min=1), default=900,
              help="Seconds a node waits for all nodes to join before failing.")
@click.option("--launcher", type=click.Choice(["torchrun", "deepspeed", "slurm"]), default="torchrun",
              help="torchrun (c10d rendezvous, elastic restarts), the DeepSpeed launcher (hostfile), or an "
                   "sbatch script that runs torchrun on every node.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, help="Restarts of the worker group after "
              "a failure (torchrun, slurm); each restart resumes from the newest checkpoint in --out "
              "(set train.checkpoint_every).")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory, the same path on every node "
              "(a shared filesystem for multi-node checkpoints); required with --nnodes > 1 for torchrun and "
              "deepspeed [default: runs/<recipe>-<timestamp>].")
@click.option("--dry-run", is_flag=True, help="Print the command (or the sbatch script) instead of running it.")
@json_option
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True), help="Passed to scaletool train.")
@click.option("--python", "python", default=sys.executable, help="Python on the nodes [default: this one].",
              show_default=False)
@click.option("--hostfile", type=click.Path(dir_okay=False), help="deepspeed: hostfile ('host slots=N' lines).")
@click.option("--hosts", help="deepspeed: comma-separated hosts; writes <out>/hostfile with --nproc-per-node slots "
              "each [default for one node: localhost].")
@click.option("--time", "time_limit", default="01:00:00", help="slurm: wall-clock limit (#SBATCH --time).")
@click.option("--partition", help="slurm: partition.")
@click.option("--account", help="slurm: account to charge.")
@click.option("--job-name", help="slurm: job name [default: scaletool-<recipe name>].")
@click.option("--gpus-per-node", type=click.IntRange(min=0), help="slurm: GPUs per node [default: "
              "--nproc-per-node]; 0 leaves the request out (CPU nodes).")
@click.option("--cpus-per-task", type=click.IntRange(min=1), help="slurm: CPUs for each node's torchrun.")
@click.option("--env", "exports", multiple=True, metavar="NAME=VALUE", help="slurm: export in the script "
              "(repeatable; the value is shell-quoted).")
@click.option("--rdzv-port", type=click.IntRange(min=1, max=65535), default=29500,
              help="slurm: rendezvous port on the first node of the allocation.")
@click.option("--workdir", type=click.Path(file_okay=False), help="slurm: directory the job starts in (relative "
              "recipe and --out paths are read from there) [default: the current directory].")
@click.option("--script", type=click.Path(dir_okay=False), help="slurm: where to write the script "
              "[default: <out>/launch.sbatch].")
@click.option("--template", type=click.Path(dir_okay=False), help="slurm: your own Jinja2 template with the "
              "variables of scaletool/launch/slurm.sbatch.j2.")
@click.option("--submit", is_flag=True, help="slurm: submit the script with sbatch and print the job id.")
def launch(recipe: str, overrides: tuple[str, ...], nnodes: int | None, nproc_per_node: int | None,
           node_rank: int | None, rdzv_endpoint: str | None, rdzv_id: str | None, rdzv_timeout_s: int, launcher: str,
           max_restarts: int,
           out: str | None, dry_run: bool, as_json: bool, peak_tflops: float | None, python: str,
           hostfile: str | None, hosts: str | None, time_limit: str, partition: str | None, account: str | None,
           job_name: str | None, gpus_per_node: int | None, cpus_per_task: int | None, exports: tuple[str, ...],
           rdzv_port: int, workdir: str | None, script: str | None, template: str | None, submit: bool) -> None:
    """Launch `scaletool train RECIPE` on one node or many, and survive worker failures.

    \b
    Every node runs `python -m scaletool train RECIPE --out DIR --auto-resume` in each rank:
    with --max-restarts, torchrun restarts the whole group after a failure (a killed worker,
    a lost node) and training continues from the newest checkpoint in DIR.
    A rank that fails prints one line naming it and the cause (out of memory, missing GPU,
    NCCL/gloo error, timeout); a rendezvous that does not form fails after --rdzv-timeout.

    \b
    Examples:
      # two nodes, 8 GPUs each: run this on both (node001 is the first node)
      scaletool launch recipes/mla-1b.yaml --nnodes 2 --nproc-per-node 8 \\
          --rdzv-endpoint node001:29500 --max-restarts 3 --out /shared/runs/mla \\
          --set parallel.engine=fsdp --set train.checkpoint_every=100
      # the DeepSpeed launcher over a hostfile (ssh to the hosts)
      scaletool launch recipes/mla-1b.yaml --launcher deepspeed --nnodes 2 --nproc-per-node 8 \\
          --hostfile launch/hostfile.example --rdzv-endpoint node001:29500 --out /shared/runs/mla \\
          --set parallel.engine=deepspeed --set parallel.zero_stage=3
      # Slurm: print the sbatch script, or write and submit it
      scaletool launch recipes/mla-1b.yaml --launcher slurm --nnodes 4 --nproc-per-node 8 \\
          --partition gpu --time 04:00:00 --max-restarts 2 --dry-run
    """
    from scaletool.cli.train import CHILD_ENV, default_out
    from scaletool.engines import check_recipe

    r = load_recipe(recipe, overrides)
    if nnodes is not None and "nnodes" in r.parallel.model_fields_set and nnodes != r.parallel.nnodes:
        raise RecipeError(f"--nnodes {nnodes}: the recipe says parallel.nnodes={r.parallel.nnodes}; make them agree "
                          "(or drop one)")
    nnodes = nnodes or r.parallel.nnodes
    nproc_per_node = nproc_per_node or r.parallel.nproc_per_node
    if out is None:
        if nnodes > 1 and launcher != "slurm":
            raise RecipeError(f"--out: required with --nnodes {nnodes}: every node must name the same run "
                              "directory (on a shared filesystem for checkpoints and restarts)")
        out = str(default_out(recipe))
    spec = LaunchSpec(recipe=recipe, out=out, nnodes=nnodes, nproc_per_node=nproc_per_node, overrides=overrides,
                      node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                      rdzv_timeout_s=rdzv_timeout_s, max_restarts=max_restarts, peak_tflops=peak_tflops,
                      python=python)
    check_spec(spec, launcher)
    check_recipe(r, nnodes * nproc_per_node, nproc_per_node)
    if r.train.checkpoint_every == 0 and max_restarts:
        click.echo("warning: --max-restarts without train.checkpoint_every: a restart starts again at step 0",
                   err=True)

    if launcher == "slurm":
        from scaletool.launch.slurm import SlurmOptions
        opts = SlurmOptions(time=time_limit, partition=partition, account=account, job_name=job_name,
                            gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, exports=exports,
                            rdzv_port=rdzv_port, workdir=workdir or os.getcwd())
        _slurm(spec, opts, template, script, submit, dry_run, as_json)
        return

    env = node_env(launcher)
    new_hostfile = None  # the text of a hostfile to write from --hosts
    if launcher == "torchrun":
        argv = torchrun_argv(spec)
    else:
        if hostfile is None:
            if not hosts and nnodes > 1:
                raise RecipeError(f"--hostfile or --hosts: required with --launcher deepspeed --nnodes {nnodes}")
            new_hostfile = hostfile_text(hosts.split(",") if hosts else ["localhost"], nproc_per_node)
            hostfile = str(Path(out) / "hostfile")
        argv = deepspeed_argv(spec, hostfile)

    if dry_run:
        if as_json:
            emit_json({"launcher": launcher, "argv": argv, "env": env, "hostfile": hostfile,
                       "hostfile_text": new_hostfile})
            return
        if new_hostfile is not None:
            click.echo(f"# {hostfile} (written when run):")
            click.echo("".join(f"#   {line}\n" for line in new_hostfile.splitlines()), nl=False)
        click.echo(_dry_run_line(env, argv))
        return

    from scaletool.launch.run import run_subprocess, run_torchrun

    _check_local_gpus(nproc_per_node)
    Path(out).mkdir(parents=True, exist_ok=True)
    if new_hostfile is not None:
        Path(hostfile).write_text(new_hostfile)
    if launcher == "deepspeed":
        read_hostfile(hostfile, spec)
    env.update(thread_env(nproc_per_node), **{CHILD_ENV: "1"})
    click.echo(f"launch: {_dry_run_line({}, argv)}", err=True)
    started = time.time()
    if launcher == "torchrun":
        outcome = run_torchrun(argv, env, spec, quiet_stdout=as_json)
    else:
        outcome = run_subprocess(argv, env, "the DeepSpeed launcher", quiet_stdout=as_json)
    _verdict(Path(out), started, outcome, as_json, launcher, argv)


def _slurm(spec: LaunchSpec, opts, template: str | None, script: str | None, submit: bool, dry_run: bool,
           as_json: bool) -> None:
    """Render the sbatch script; print it (--dry-run), or write it and, with --submit, submit it."""
    from scaletool.launch.slurm import render_sbatch
    from scaletool.launch.slurm import submit as sbatch_submit

    text = render_sbatch(spec, opts, template)
    path = Path(script) if script else Path(spec.out) / "launch.sbatch"
    if dry_run:
        if as_json:
            emit_json({"launcher": "slurm", "script": text, "script_path": str(path)})
        else:
            click.echo(text, nl=False)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    job_id = sbatch_submit(path) if submit else None
    if as_json:
        emit_json({"launcher": "slurm", "script_path": str(path), "job_id": job_id, "out_dir": spec.out})
    elif job_id:
        click.echo(f"submitted job {job_id}: {path}; run directory {spec.out}")
    else:
        click.echo(f"wrote {path}; submit it with: sbatch {shlex.quote(str(path))}")
