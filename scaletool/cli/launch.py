"""``scaletool launch torchrun|deepspeed|slurm``: start ``scaletool train`` on one node or many.

One subcommand per launcher; the options they share (the job's shape, the run directory, dry run,
JSON) are defined once below and stacked onto each.
"""
from __future__ import annotations

import difflib
import json
import os
import shlex
import sys
import time
from pathlib import Path

import click

from scaletool.cli.options import PositiveFloat, deliver, json_option, recipe_argument, set_option
from scaletool.errors import RecipeError, cannot_write, shorten
from scaletool.fmt import write_atomic
from scaletool.hf import load_recipe
from scaletool.launch.commands import (
    LaunchSpec,
    check_spec,
    deepspeed_argv,
    hostfile_text,
    node_env,
    pdsh_problems,
    read_hostfile,
    thread_env,
    torchrun_argv,
    train_module_args,
    uses_pdsh,
)


def _stack(*decorators):
    """Apply ``decorators`` in the order written (the first is the outermost, listed first in --help)."""
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


# -- options, defined once ----------------------------------------------------------------------

job_options = _stack(
    recipe_argument,
    set_option,
    click.option("--nnodes", type=click.IntRange(min=1), help="Nodes in the job [default: parallel.nnodes, 1]."),
    click.option("--nproc-per-node", type=click.IntRange(min=1), help="Ranks per node, one per GPU [default: "
                 "parallel.nproc_per_node, 1]."),
    click.option("--out", type=click.Path(file_okay=False), help="Run directory, the same path on every node (a "
                 "shared filesystem for multi-node checkpoints) [default: runs/<recipe>-<timestamp>]."),
    click.option("--dry-run", is_flag=True, help="Print what would run instead of running it."),
    json_option,
    click.option("--peak-tflops", type=PositiveFloat(), help="Passed to scaletool train."),
    click.option("--python", "python", default=sys.executable, show_default=False,
                 help="Python on the nodes [default: this one]."),
)

rdzv_timeout_option = click.option(
    "--rdzv-timeout", "rdzv_timeout_s", type=click.IntRange(min=1), default=900, show_default=True,
    help="Seconds a node waits for all nodes to join before failing.")

max_restarts_option = click.option(
    "--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
    help="Restarts of the worker group after a failure; each restart resumes from the newest checkpoint in "
         "--out (set train.checkpoint_every).")


def node_options(node_rank_help: str, endpoint_help: str):
    """--node-rank and --rdzv-endpoint, worded for the launcher that reads them."""
    return _stack(click.option("--node-rank", type=click.IntRange(min=0), help=node_rank_help),
                  click.option("--rdzv-endpoint", metavar="HOST:PORT", help=endpoint_help))


# -- what every launcher does before it starts anything ------------------------------------------


def prepare(recipe: str, overrides: tuple[str, ...], launcher: str, *, nnodes: int | None,
            nproc_per_node: int | None, out: str | None, **spec_fields) -> LaunchSpec:
    """The checked launch of ``recipe``: its shape agrees with the recipe, the recipe with the shape,
    and every problem is a RecipeError line before any process starts."""
    from scaletool.cli.train import default_out
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
                      **spec_fields)
    check_spec(spec, launcher)
    check_recipe(r, nnodes * nproc_per_node, nproc_per_node)
    if r.train.checkpoint_every == 0 and spec.max_restarts:
        click.echo("warning: --max-restarts without train.checkpoint_every: a restart starts again at step 0",
                   err=True)
    return spec


def _command_line(env: dict[str, str], argv: list[str]) -> str:
    """``NAME=VALUE ... python -m ...``: one line a shell runs as is."""
    return shlex.join([f"{k}={v}" for k, v in env.items()] + argv)


def _check_local_gpus(nproc_per_node: int) -> None:
    """Ranks on this node each take a GPU when CUDA is present: fail before starting if too few."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc_per_node:
        raise RecipeError(f"--nproc-per-node {nproc_per_node}: this node has {torch.cuda.device_count()} CUDA "
                          "device(s), one per rank is needed (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def _check_local_python(launcher: str, python: str) -> None:
    """--python on a run here: an interpreter this node can start; torchrun's agent is this process, and
    its workers run this interpreter, so there --python may only name this one."""
    import shutil

    found = shutil.which(python)
    if found is None or not Path(found).is_file():
        raise RecipeError(f"--python {shorten(python)}: not an executable on this node")
    if launcher == "torchrun" and os.path.abspath(found) != os.path.abspath(sys.executable):
        raise RecipeError(f"--python {shorten(python)}: torchrun runs in this process and starts its workers with "
                          f"this Python ({sys.executable}); run `python -m scaletool launch torchrun ...` with that "
                          "Python instead (--python names the nodes' Python in --dry-run commands and sbatch scripts)")


def run_on_this_node(launcher: str, spec: LaunchSpec, argv: list[str], env: dict[str, str], as_json: bool,
                     before=None):
    """Run this node's launcher process (torchrun in this process, DeepSpeed's as a child), then report
    from rank 0's summary.json and exit with its status. ``before`` runs once the run directory exists."""
    import contextlib

    from scaletool.sweep.lock import run_lock

    _check_local_gpus(spec.nproc_per_node)
    _check_local_python(launcher, spec.python)
    out = Path(spec.out)
    with cannot_write(out, "the run directory"):
        out.mkdir(parents=True, exist_ok=True)
    # one node: no other launch may train into this directory meanwhile (several nodes share it on purpose)
    with run_lock(out, f"scaletool launch {launcher} {spec.recipe}") if spec.nnodes == 1 else contextlib.nullcontext():
        return _run_and_report(launcher, spec, argv, env, as_json, before, out)


def _run_and_report(launcher: str, spec: LaunchSpec, argv: list[str], env: dict[str, str], as_json: bool, before,
                    out: Path):
    from scaletool.cli.train import CHILD_ENV
    from scaletool.launch.run import run_subprocess, run_torchrun
    from scaletool.results.launch import LaunchResult

    if before is not None:
        before()
    env = {**env, **thread_env(spec.nproc_per_node), CHILD_ENV: "1"}
    click.echo(f"launch: {_command_line({}, argv)}", err=True)
    started = time.time()
    if launcher == "torchrun":
        outcome = run_torchrun(argv, env, spec, quiet_stdout=as_json)
    else:
        outcome = run_subprocess(argv, env, "the DeepSpeed launcher", quiet_stdout=as_json)
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() and path.stat().st_mtime >= started else None
    errors, code = list(outcome.errors), outcome.exit_code
    stop = stop_line(code, summary, out)
    if stop is not None:  # a stop, not a failure: where it stopped and how to go on, as `train` says it
        errors = [stop]
    if code == 0 and summary is not None and summary.get("status") != "completed":
        errors.append(f"error: {summary.get('message') or summary.get('status')}")
        code = 1
    res = deliver(LaunchResult(launcher=launcher, dry_run=False, argv=argv, exit_code=code, errors=errors,
                               out_dir=str(out), summary=summary), as_json)
    for line in errors:
        click.echo(line, err=True)
    if code == 0:
        if summary is None:
            click.echo(f"this node's ranks finished; rank 0 writes {path} on its node", err=True)
        else:
            restarts = (summary.get("elastic") or {}).get("restart_count")
            click.echo(f"{out}: {summary['steps_completed']} steps, loss {summary['loss_first']:.4g} -> "
                       f"{summary['loss_last']:.4g}" + (f", {restarts} restart(s)" if restarts else ""), err=True)
    if code:
        sys.exit(code)
    return res


def stop_line(code: int, summary: dict | None, out: Path) -> str | None:
    """For a launch stopped by SIGTERM or SIGINT (exit 143, 130) whose rank 0 recorded where: ``stopped by
    SIGTERM after 37 of 2000 steps; checkpoint ...; resume: <this command>`` (the ranks start with
    --auto-resume, so the same command continues); None otherwise."""
    from scaletool.train.checkpoint import newest_intact

    message = (summary or {}).get("message") or ""
    if code not in (128 + 2, 128 + 15) or not message.startswith("stopped by"):
        return None
    found = newest_intact(out)[0] if out.is_dir() else None
    where = f"; checkpoint {found[0]}" if found is not None else "; no checkpoint (train.checkpoint_every is 0)"
    return f"{message}{where}; resume: {shlex.join(['scaletool', *sys.argv[1:]])}"


# -- the group and its launchers -----------------------------------------------------------------


class LaunchGroup(click.Group):
    def resolve_command(self, ctx: click.Context, args: list[str]):
        # the one-command form of earlier versions (`launch RECIPE --launcher X`): say what changed
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            close = difflib.get_close_matches(args[0], list(self.commands), n=1)
            raise click.UsageError(f"no launcher '{args[0]}'; did you mean '{close[0]}'?" if close else
                                   f"'{args[0]}' is not a launcher: name the launcher first, e.g. `scaletool launch "
                                   f"torchrun {args[0]} ...` (launchers: {', '.join(self.commands)})", ctx)
        return super().resolve_command(ctx, args)


@click.group(cls=LaunchGroup)
def launch() -> None:
    """Launch `scaletool train RECIPE` on one node or many, and survive worker failures.

    Every node runs `python -m scaletool train RECIPE --out DIR --auto-resume` in each rank: after
    a failure (a killed worker, a lost node) a restarted group continues from the newest checkpoint
    in DIR. A rank that fails prints one line naming it and the cause (out of memory, missing GPU,
    NCCL/gloo error, timeout); a rendezvous that does not form fails after --rdzv-timeout.

    \b
    Examples:
      scaletool launch torchrun tiny --nproc-per-node 2 --set parallel.engine=ddp
      scaletool launch slurm mla-1b --nnodes 4 --nproc-per-node 8 \\
          --partition gpu --dry-run
    """


@launch.command(context_settings={"show_default": True})
@job_options
@node_options("This node's index; 0 hosts the rendezvous store (otherwise the node whose hostname matches the "
              "endpoint does).",
              "Where the nodes meet (the first node's address); required with --nnodes > 1.")
@click.option("--rdzv-id", help="Rendezvous id, the same on every node [default: scaletool-<out dir name>].")
@rdzv_timeout_option
@max_restarts_option
def torchrun(recipe: str, overrides: tuple[str, ...], nnodes: int | None, nproc_per_node: int | None,
             out: str | None, dry_run: bool, as_json: bool, peak_tflops: float | None, python: str,
             node_rank: int | None, rdzv_endpoint: str | None, rdzv_id: str | None, rdzv_timeout_s: int,
             max_restarts: int):
    """Run torchrun on this node (c10d rendezvous, elastic restarts); start it on every node.

    This process becomes the node's torchrun agent. One node: --standalone. Several: the same
    --rdzv-endpoint, --out and --rdzv-id on every node; --max-restarts K restarts the whole worker
    group up to K times, and training resumes from the newest checkpoint.

    \b
    Examples:
      scaletool launch torchrun tiny --nproc-per-node 2 --set parallel.engine=fsdp
      # two nodes, 8 GPUs each: run this on both (node001 is the first node)
      scaletool launch torchrun mla-1b --nnodes 2 --nproc-per-node 8 \\
          --rdzv-endpoint node001:29500 --max-restarts 3 --out /shared/runs/mla \\
          --set parallel.engine=fsdp --set train.checkpoint_every=100
    """
    spec = prepare(recipe, overrides, "torchrun", nnodes=nnodes, nproc_per_node=nproc_per_node, out=out,
                   node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, rdzv_timeout_s=rdzv_timeout_s,
                   max_restarts=max_restarts, peak_tflops=peak_tflops, python=python)
    argv, env = torchrun_argv(spec), node_env("torchrun")
    if not dry_run:
        return run_on_this_node("torchrun", spec, argv, env, as_json)
    from scaletool.results.launch import LaunchResult

    if not as_json:
        click.echo(_command_line(env, argv))
    return deliver(LaunchResult(launcher="torchrun", dry_run=True, argv=argv, env=env), as_json)


@launch.command(context_settings={"show_default": True})
@job_options
@node_options("Run this node's ranks only (no ssh); start launch on every node with its index.",
              "The master address and port (rank 0's host); required with --nnodes > 1.")
@click.option("--hostfile", type=click.Path(dir_okay=False), help="'host slots=N' lines, read with DeepSpeed's "
              "own parser.")
@click.option("--hosts", help="Comma-separated hosts; writes <out>/hostfile with --nproc-per-node slots each "
              "[default for one node: localhost].")
@rdzv_timeout_option
# the DeepSpeed launcher has no restarts: accepted only to say so and point to torchrun
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, hidden=True)
def deepspeed(recipe: str, overrides: tuple[str, ...], nnodes: int | None, nproc_per_node: int | None,
              out: str | None, dry_run: bool, as_json: bool, peak_tflops: float | None, python: str,
              node_rank: int | None, rdzv_endpoint: str | None, hostfile: str | None, hosts: str | None,
              rdzv_timeout_s: int, max_restarts: int):
    """Run the DeepSpeed launcher over a hostfile (it reaches the hosts over pdsh/ssh).

    Without --node-rank it starts every host's ranks itself; with --node-rank R it runs this node's
    ranks only (start it on every node). It has no rendezvous of its own: the ranks wait up to
    --rdzv-timeout for each other at the endpoint, then fail with one line. It does not restart
    failed workers: for restarts use `scaletool launch torchrun`, which runs parallel.engine=deepspeed too.

    \b
    Examples:
      scaletool launch deepspeed tiny --nproc-per-node 2 \\
          --set parallel.engine=deepspeed
      scaletool launch deepspeed mla-1b --nnodes 2 --nproc-per-node 8 \\
          --hostfile launch/hostfile.example --rdzv-endpoint node001:29500 \\
          --out /shared/runs/mla \\
          --set parallel.engine=deepspeed --set parallel.zero_stage=3
    """
    spec = prepare(recipe, overrides, "deepspeed", nnodes=nnodes, nproc_per_node=nproc_per_node, out=out,
                   node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
                   rdzv_timeout_s=rdzv_timeout_s, join_timeout_s=rdzv_timeout_s, peak_tflops=peak_tflops,
                   python=python)
    if uses_pdsh(spec) and (problems := pdsh_problems(spec)):
        raise RecipeError(problems)
    new_hostfile = None  # the text of a hostfile to write from --hosts
    if hostfile is not None and hosts is not None:
        raise RecipeError("--hostfile and --hosts: give one (--hosts writes <out>/hostfile)")
    if hostfile is None:
        if not hosts and spec.nnodes > 1:
            raise RecipeError(f"--hostfile or --hosts: required with --nnodes {spec.nnodes}")
        new_hostfile = hostfile_text(hosts.split(",") if hosts else ["localhost"], spec.nproc_per_node)
        hostfile = str(Path(spec.out) / "hostfile")
    argv, env = deepspeed_argv(spec, hostfile), node_env("deepspeed")
    if not dry_run:
        def write_and_check_hostfile():
            if new_hostfile is not None:  # every node writes the same text: a reader sees it whole
                with cannot_write(hostfile):
                    write_atomic(Path(hostfile), new_hostfile)
            read_hostfile(hostfile, spec)
        return run_on_this_node("deepspeed", spec, argv, env, as_json, before=write_and_check_hostfile)
    from scaletool.results.launch import LaunchResult

    if not as_json:
        if new_hostfile is not None:
            click.echo(f"# {hostfile} (written when run):")
            click.echo("".join(f"#   {line}\n" for line in new_hostfile.splitlines()), nl=False)
        if uses_pdsh(spec):
            click.echo(f"# every rank runs: {shlex.join(train_module_args(spec))}\n# (passed as the one word below: "
                       "DeepSpeed's pdsh runner hands its command to each host's shell)")
        click.echo(_command_line(env, argv))
    return deliver(LaunchResult(launcher="deepspeed", dry_run=True, argv=argv, env=env, hostfile=hostfile,
                                hostfile_text=new_hostfile), as_json)


@launch.command(context_settings={"show_default": True})
@job_options
@rdzv_timeout_option
@max_restarts_option
@click.option("--time", "time_limit", default="01:00:00", help="Wall-clock limit (#SBATCH --time).")
@click.option("--partition", help="Partition.")
@click.option("--account", help="Account to charge.")
@click.option("--job-name", help="Job name [default: scaletool-<recipe name>].")
@click.option("--gpus-per-node", type=click.IntRange(min=0), help="GPUs per node [default: --nproc-per-node]; "
              "0 leaves the request out (CPU nodes).")
@click.option("--cpus-per-task", type=click.IntRange(min=1), help="CPUs for each node's torchrun.")
@click.option("--env", "exports", multiple=True, metavar="NAME=VALUE", help="Export in the script (repeatable; "
              "the value is shell-quoted).")
@click.option("--rdzv-port", type=click.IntRange(min=1, max=65535), default=29500,
              help="Rendezvous port on the first node of the allocation.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Directory the job starts in (relative recipe "
              "and --out paths are read from there) [default: the current directory].")
@click.option("--script", type=click.Path(dir_okay=False), help="Where to write the script [default: "
              "<out>/launch.sbatch].")
@click.option("--template", type=click.Path(dir_okay=False), help="Your own Jinja2 template with the variables "
              "of scaletool/launch/slurm.sbatch.j2.")
@click.option("--submit", is_flag=True, help="Submit the script with sbatch and print the job id.")
def slurm(recipe: str, overrides: tuple[str, ...], nnodes: int | None, nproc_per_node: int | None, out: str | None,
          dry_run: bool, as_json: bool, peak_tflops: float | None, python: str, rdzv_timeout_s: int,
          max_restarts: int, time_limit: str, partition: str | None, account: str | None, job_name: str | None,
          gpus_per_node: int | None, cpus_per_task: int | None, exports: tuple[str, ...], rdzv_port: int,
          workdir: str | None, script: str | None, template: str | None, submit: bool):
    """Write an sbatch script that runs torchrun on every node through srun (and submit it).

    The script is rendered from scaletool/launch/slurm.sbatch.j2 (or --template): one torchrun per
    node, meeting at the allocation's first node, rendezvous id $SLURM_JOB_ID, and
    `srun --kill-on-bad-exit=1` so a failed node never leaves the others waiting.

    \b
    Examples:
      scaletool launch slurm mla-1b --nnodes 4 --nproc-per-node 8 \\
          --partition gpu --time 04:00:00 --max-restarts 2 --dry-run
      scaletool launch slurm mla-1b --nnodes 2 --nproc-per-node 8 \\
          --out /shared/runs/mla --submit
    """
    from scaletool.launch.slurm import SlurmOptions, render_sbatch
    from scaletool.launch.slurm import submit as sbatch_submit
    from scaletool.results.launch import LaunchResult

    spec = prepare(recipe, overrides, "slurm", nnodes=nnodes, nproc_per_node=nproc_per_node, out=out,
                   rdzv_timeout_s=rdzv_timeout_s, max_restarts=max_restarts, peak_tflops=peak_tflops, python=python)
    opts = SlurmOptions(time=time_limit, partition=partition, account=account, job_name=job_name,
                        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, exports=exports,
                        rdzv_port=rdzv_port, workdir=workdir or os.getcwd())
    text = render_sbatch(spec, opts, template)
    path = Path(script) if script else Path(spec.out) / "launch.sbatch"
    if dry_run:
        if not as_json:
            click.echo(text, nl=False)
        return deliver(LaunchResult(launcher="slurm", dry_run=True, script=text, script_path=str(path)), as_json)
    with cannot_write(path, "the batch script"):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, follow_links=script is not None)  # a path the user named is followed
    job_id = sbatch_submit(path) if submit else None
    res = deliver(LaunchResult(launcher="slurm", dry_run=False, script_path=str(path), job_id=job_id,
                               out_dir=spec.out), as_json)
    if not as_json:
        click.echo(f"submitted job {job_id}: {path}; run directory {spec.out}" if job_id
                   else f"wrote {path}; submit it with: sbatch {shlex.quote(str(path))}")
    return res
