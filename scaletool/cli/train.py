"""``scaletool train``: train a recipe's model with one of four engines and measure it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from scaletool.cli.options import deliver, json_option, recipe_argument, set_option
from scaletool.config import RecipeError, load_recipe

# Set by the --nproc-per-node parent for its torchrun children: they write summary.json and leave
# the verdict (exit status, error line, --json output) to the parent, so torchrun never reports a
# diverged run as a crashed child with a traceback.
CHILD_ENV = "SCALETOOL_TRAIN_CHILD"


def default_out(recipe: str) -> Path:
    return Path("runs") / f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _launch(recipe_path: str, r, nproc: int, out: Path, overrides, resume, peak_tflops, measure, as_json) -> None:
    """Re-run this command under ``python -m torch.distributed.run --standalone`` with ``nproc`` local ranks."""
    from scaletool.engines import check_recipe
    from scaletool.launch.commands import LaunchSpec, thread_env, torchrun_argv
    from scaletool.train.data import make_source

    check_recipe(r, nproc, nproc)
    make_source(r, 0, nproc)  # a missing or malformed data file fails here, once, before any rank starts
    cmd = torchrun_argv(LaunchSpec(recipe_path, str(out), nproc_per_node=nproc, overrides=tuple(overrides),
                                   peak_tflops=peak_tflops, resume=resume, measure=measure))
    env = {**os.environ, CHILD_ENV: "1", **thread_env(nproc)}
    rc = subprocess.run(cmd, env=env, stdout=sys.stderr if as_json else None).returncode
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if rc != 0 or summary is None:
        click.echo(f"error: {nproc}-process run failed (torchrun exit status {rc}); see the log above"
                   + (f" and {out / 'train.log'}" if (out / "train.log").is_file() else ""), err=True)
        sys.exit(rc or 1)
    return _finish(summary, as_json)


def _finish(summary: dict, as_json: bool) -> dict:
    deliver(summary, as_json)
    if summary["status"] != "completed":
        click.echo(f"error: {summary['message']}", err=True)
        sys.exit(1)
    return summary


@click.command(context_settings={"show_default": True})
@recipe_argument
@set_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Run directory for summary.json, metrics.jsonl, train.log, TensorBoard scalars and "
                   "checkpoints [default: runs/<recipe>-<timestamp>].")
@json_option
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out (same loss curve, "
              "same step count).")
@click.option("--auto-resume", is_flag=True, help="Like --resume when --out holds a checkpoint, else start at "
              "step 0 (what `scaletool launch` passes: a restarted worker group continues where it failed).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Start this many local ranks with torchrun "
              "(python -m torch.distributed.run --standalone) and run this command in each.")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True),
              help="Accelerator peak for MFU, overriding profiles/*.yaml (needed for unknown GPUs and CPUs).")
@click.option("--measure/--no-measure", default=True, help="Per-step timing, loss logging every "
              "train.log_every steps, NVML sampling and TensorBoard; throughput is measured either way.")
@click.option("--local_rank", "--local-rank", "local_rank", type=int, hidden=True)  # the DeepSpeed launcher's
def train(recipe: str, overrides: tuple[str, ...], out: Path | None, as_json: bool, resume: bool, auto_resume: bool,
          nproc_per_node: int | None, peak_tflops: float | None, measure: bool, local_rank: int | None) -> None:
    """Train RECIPE's model and measure throughput, MFU and memory against the analytic model.

    \b
    Engines (parallel.engine): single, ddp, fsdp (FSDP2), deepspeed (ZeRO 0-3).
    Runs as one process, as one rank of torchrun or the DeepSpeed launcher (env://),
    or starts N local ranks itself with --nproc-per-node N (gloo on CPU, nccl on CUDA).

    \b
    Examples:
      scaletool train recipes/tiny.yaml
      scaletool train recipes/tiny.yaml --nproc-per-node 2 --set parallel.engine=fsdp
      scaletool train recipes/mla-1b.yaml --set train.log_every=10 --json
      torchrun --nproc-per-node 8 -m scaletool train recipes/mha-1b.yaml --set parallel.engine=deepspeed \\
          --set parallel.zero_stage=3

    The first train.measure_warmup_steps steps (and compilation) are not measured. summary.json
    holds tokens_per_s (global), mfu (null without a known peak), peak_memory_bytes, loss_first,
    loss_last and every other figure; --json prints it.
    """
    from scaletool.engines import check_recipe, launcher_env

    r = load_recipe(recipe, overrides)
    resume = "auto" if auto_resume else resume
    le = launcher_env()
    if nproc_per_node is not None and not le["launched"]:
        if nproc_per_node > 1 or r.parallel.engine != "single":
            out = out or default_out(recipe)
            return _launch(recipe, r, nproc_per_node, out, overrides, resume, peak_tflops, measure, as_json)
    elif nproc_per_node is not None and nproc_per_node != le["local_world_size"]:
        raise RecipeError(f"--nproc-per-node {nproc_per_node}: this process is one of {le['local_world_size']} "
                          "local ranks started by a launcher; drop the option or make them agree")
    check_recipe(r, le["world_size"], le["local_world_size"] if le["launched"] else None)
    return _run_rank(r, recipe, out, resume, peak_tflops, measure, as_json)


def _run_rank(r, recipe: str, out: Path | None, resume: bool | str, peak_tflops, measure: bool, as_json: bool) -> dict:
    import torch.distributed as dist

    from scaletool.engines import agree, init_distributed
    from scaletool.launch.failures import reported_failures
    from scaletool.train.loop import run

    child = os.environ.get(CHILD_ENV) == "1"
    # Any other failure of this rank (out of memory, a missing GPU, NCCL/gloo errors, timeouts) ends
    # as one line naming the rank and the cause, also in torchrun's error file, and exit status 1.
    with reported_failures():
        env = init_distributed(r.parallel.engine, r.parallel.collective_timeout_s)
        try:
            out = agree(out or default_out(recipe), env)
            summary = run(r, out, env, resume=resume, peak_tflops=peak_tflops, measure=measure, quiet=as_json)
        except RecipeError:
            if env.rank != 0:  # every rank finds the same problem; one of them reports it
                sys.exit(2)
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if env.is_main and not child:
        summary = _finish(summary, as_json)
    if env.world_size > 1:
        # Everything is written and the process group is gone. A worker process now skips the
        # interpreter's native teardown: DeepSpeed ZeRO-3 over gloo intermittently aborts there
        # ("terminate called without an active exception": a joinable C++ thread destroyed at exit,
        # seen in about 1 of 4 CPU runs), which torchrun would report as a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return summary
