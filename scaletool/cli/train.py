"""``scaletool train``: train a recipe's model with one of four engines and measure it."""
from __future__ import annotations

import os
import shlex
import signal
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
    from scaletool.train.trainer import Stopped, TrainFailed, stop_on_signals, stop_signal

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
            sig = cause.signum if isinstance(cause, Stopped) else stop_signal()  # a library may wrap the stop
            if sig is not None:
                stopped(sig, failed.result, out)
            if cause is not None:
                raise cause from None  # reported_failures: the rank's line (and traceback, error file)
            where = f"{rank_label()}: " if le["launched"] else ""
            for line in failed.lines:
                click.echo(f"error: {where}{line}", err=True)
            sys.exit(1)
        except (Stopped, KeyboardInterrupt) as e:  # before training started: imports, the build, the first compile
            stopped(e.signum if isinstance(e, Stopped) else signal.SIGINT, None, out)
        except Exception:
            if stop_signal() is not None:  # what the handler raised, wrapped by a library on its way out
                stopped(stop_signal(), None, out)
            raise


def stopped(signum: int, result, out: Path | None) -> None:
    """End a run stopped by a signal: one line on rank 0 (none from the other ranks, nor from the ranks
    `train --nproc-per-node` starts: their parent says it) naming the step it stopped after, the checkpoint
    a resume starts from and the command that resumes it; exit status 128 + the signal (143, 130)."""
    from scaletool.engines import launcher_env
    from scaletool.train.checkpoint import newest_intact

    if launcher_env()["rank"] == 0 and os.environ.get(CHILD_ENV) != "1":
        click.echo(stop_line(signum, result, out, newest_intact), err=True)
    sys.exit(128 + signum)


def stop_line(signum: int, result, out: Path | None, newest_intact) -> str:
    """``stopped by SIGTERM after 37 of 2000 steps; checkpoint run/checkpoints/step_36; resume: scaletool train
    ... --resume`` (every argument of this command kept, shell-quoted)."""
    name = signal.Signals(signum).name
    run_dir = Path(result.out_dir) if result is not None and result.out_dir else out
    argv = [a for a in sys.argv[1:] if a not in ("--resume", "--auto-resume")]
    if run_dir is not None and not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", str(run_dir)]
    found = newest_intact(run_dir)[0] if run_dir is not None and run_dir.is_dir() else None
    # --auto-resume: continues from a checkpoint, or starts at step 0 in a directory holding a stopped run's summary
    again = shlex.join(["scaletool", *argv, "--auto-resume"] if run_dir is not None else ["scaletool", *sys.argv[1:]])
    if result is None or not result.steps_completed:
        if found is not None:  # a resumed run stopped before its first step: its checkpoint still holds
            return f"stopped by {name} before the first step; resume: {shlex.join(['scaletool', *argv, '--resume'])}"
        return f"stopped by {name} before the first step; nothing to resume: start again with {again}"
    planned = ((result.recipe or {}).get("train") or {}).get("steps")
    where = f"stopped by {name} after {result.steps_completed} of {planned or '?'} steps"
    if found is None:
        return f"{where}; no checkpoint (train.checkpoint_every is 0): start again with {again}"
    return f"{where}; checkpoint {found[0]}; resume: {shlex.join(['scaletool', *argv, '--resume'])}"
