"""``scaletool train``: train a recipe's model with one of four engines and measure it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from scaletool.cli.options import PositiveFloat, deliver, json_option, recipe_argument, set_option
from scaletool.fmt import stdout_to_stderr
from scaletool.train.run import TRAIN_CHILD_ENV as CHILD_ENV  # noqa: F401 (what `scaletool launch` sets for its ranks)
from scaletool.train.run import WANDB_ENV
from scaletool.train.run import default_out as _default_out


def default_out(recipe: str) -> Path:
    return _default_out(recipe)


@click.command(context_settings={"show_default": True})
@recipe_argument
@set_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Run directory for summary.json, metrics.jsonl, train.log, TensorBoard scalars and "
                   "checkpoints [default: runs/<recipe>-<timestamp>]. One run per directory: an existing run "
                   "is continued with --resume, never overwritten.")
@json_option
@click.option("--resume", is_flag=True, help="Continue from the newest intact checkpoint in --out (same loss curve; "
              "raise train.steps to train further). A finished run is left as it is.")
@click.option("--auto-resume", is_flag=True, help="Like --resume when --out holds a checkpoint, else start at "
              "step 0 (what `scaletool launch` passes: a restarted worker group continues where it failed).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Start this many local ranks with torchrun "
              "(python -m torch.distributed.run --standalone) and run this command in each.")
@click.option("--peak-tflops", type=PositiveFloat(),
              help="Accelerator peak for MFU, overriding profiles/*.yaml (needed for unknown GPUs and CPUs).")
@click.option("--measure/--no-measure", default=True, help="Per-step timing, loss logging every "
              "train.log_every steps, NVML sampling and TensorBoard; throughput is measured either way.")
@click.option("--wandb", metavar="offline|online[:PROJECT]", envvar=WANDB_ENV,
              help="Also log to Weights & Biases (pip install 'scaletool[wandb]'); offline writes under "
                   "<out>/wandb without a network (wandb sync uploads it later).")
@click.option("--join-timeout", "join_timeout_s", type=click.IntRange(min=1), metavar="SECONDS",
              help="Under a launcher without a rendezvous of its own (the DeepSpeed launcher): fail when the ranks "
                   "have not all met at MASTER_ADDR:MASTER_PORT within SECONDS, instead of waiting the group's "
                   "whole timeout (`scaletool launch deepspeed` passes its --rdzv-timeout).")
@click.option("--local_rank", "--local-rank", "local_rank", type=int, hidden=True)  # the DeepSpeed launcher's
def train(recipe: str, overrides: tuple[str, ...], out: Path | None, as_json: bool, resume: bool, auto_resume: bool,
          nproc_per_node: int | None, peak_tflops: float | None, measure: bool, wandb: str | None,
          join_timeout_s: int | None, local_rank: int | None):
    """Train RECIPE's model and measure throughput, MFU and memory against the analytic model.

    \b
    Engines (parallel.engine): single, ddp, fsdp (FSDP2), deepspeed (ZeRO 0-3).
    Runs as one process, as one rank of torchrun or the DeepSpeed launcher
    (env://), or starts N local ranks itself with --nproc-per-node N (gloo
    on CPU, nccl on CUDA). FP8 GEMMs: --set train.float8=tensorwise|rowwise.

    \b
    Examples:
      scaletool train recipes/tiny.yaml
      scaletool train tiny --nproc-per-node 2 --set parallel.engine=fsdp
      scaletool train recipes/mla-1b.yaml --set train.log_every=10 --json
      scaletool train recipes/tiny.yaml --out runs/a --resume --set train.steps=20
      torchrun --nproc-per-node 8 -m scaletool train mha-1b \\
          --set parallel.engine=deepspeed --set parallel.zero_stage=3

    Throughput and MFU: the median step, warm-up excluded by rule; summary.json
    holds every figure (timing with p10/p90 and n); --json prints it.
    """
    from scaletool.engines import launcher_env
    from scaletool.engines.dist import end_worker_process

    mode = "auto" if auto_resume else "required" if resume else "never"
    result = _run(recipe, overrides, out, mode, peak_tflops, measure, as_json, wandb, nproc_per_node, join_timeout_s)
    le = launcher_env()
    if le["rank"] == 0 and os.environ.get(CHILD_ENV) != "1":
        deliver(result, as_json)
        if result.status != "completed":
            click.echo(f"error: {result.message}", err=True)
            sys.exit(1)
    if le["launched"] and le["world_size"] > 1:
        end_worker_process()  # everything is written and the group is gone: no native teardown to abort in
    return result


def _run(recipe, overrides, out, mode, peak_tflops, measure, as_json, wandb, nproc_per_node, join_timeout_s):
    """Run api.train here (one rank, alone or started by a launcher) or over local ranks.

    A failure of a rank (out of memory, a missing GPU, NCCL/gloo errors, timeouts) ends as one line
    naming the rank and the cause, also in torchrun's error file, and exit status 1; failed local
    ranks give one line each, root cause first; SIGTERM stops the run with its partial result. In
    every case rank 0's partial result is still delivered (--json, --result-file).
    """
    from scaletool import api
    from scaletool.engines import launcher_env
    from scaletool.errors import RecipeError, rank_label
    from scaletool.launch.failures import reported_failures
    from scaletool.train.trainer import Stopped, TrainFailed, stop_on_signals

    le = launcher_env()
    with reported_failures(), stop_on_signals():
        try:
            with stdout_to_stderr(as_json):  # the ranks' and libraries' prints; stdout keeps the JSON
                return api.train(recipe, overrides=overrides, out=out, resume=mode, peak_tflops=peak_tflops,
                                 measure=measure, nproc_per_node=nproc_per_node, quiet=as_json, wandb=wandb,
                                 join_timeout_s=join_timeout_s)
        except RecipeError:
            if le["rank"] != 0:  # every rank finds the same problem; one of them reports it
                sys.exit(2)
            raise
        except TrainFailed as failed:
            if le["rank"] == 0 and os.environ.get(CHILD_ENV) != "1":
                deliver(failed.result, as_json)
            cause = failed.__cause__
            if cause is not None and not isinstance(cause, Stopped):
                raise cause from None  # reported_failures: the rank's line (and traceback, error file)
            where = f"{rank_label()}: " if le["launched"] else ""
            for line in failed.lines:
                click.echo(f"error: {where}{line}", err=True)
            sys.exit(143 if isinstance(cause, Stopped) else 1)
