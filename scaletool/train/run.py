"""One training run, start to finish, from a typed request: this process's own rank, or N local ranks under torchrun.

:func:`scaletool.api.train` checks its arguments, takes the run directory's lock and hands a
:class:`TrainRequest` to :func:`run_train`, which decides where the ranks run:

- outside a launcher with ``nproc_per_node`` N (or a distributed engine): this process is the agent of N local
  ranks started under torchrun (:func:`train_local_ranks`), and returns rank 0's summary;
- otherwise this process is one rank (alone, or started by torchrun or the DeepSpeed launcher): it joins
  the process group, trains and leaves it (:func:`train_rank`).

Weights & Biases logging travels from a parent to the ranks it starts in :data:`WANDB_ENV`; a rank that a
parent started knows it by :data:`TRAIN_CHILD_ENV`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletool.config import Recipe
from scaletool.errors import RecipeError
from scaletool.kinds.engines import engine_kind

if TYPE_CHECKING:  # the module stays torch-free to import: `scaletool train --help` and api need only its names
    from scaletool.train.resume import Resume

#: set by a parent that starts local ranks for their process: they write summary.json and leave the
#: verdict (exit status, error lines, --json output) to the parent
TRAIN_CHILD_ENV = "SCALETOOL_TRAIN_CHILD"
#: ``mode[:project]`` of Weights & Biases logging, how a parent hands it to the ranks it starts
WANDB_ENV = "SCALETOOL_WANDB"


def default_out(recipe: str | Path | Recipe) -> Path:
    """``runs/<recipe name>-<timestamp>``."""
    stem = Path(recipe).stem if isinstance(recipe, (str, Path)) else "train"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


@dataclass(frozen=True)
class TrainRequest:
    """One run, its arguments already checked (:func:`scaletool.api.train` builds it).

    ``recipe`` is the validated recipe; ``source`` what the caller named (a path, or the Recipe itself) with
    the caller's ``overrides`` (``--set`` text) and ``settings`` (dotted key -> value, set by the package), which
    local ranks re-read in their own processes. ``launcher`` is :func:`scaletool.engines.launcher_env`'s view
    of this process; ``recipe_callbacks(recipe)`` the callbacks the recipe asks for (its profiler and monitors),
    made on each rank ahead of ``callbacks``; ``wandb`` the parsed options (None: off) and ``wandb_spec`` the
    text handed to ranks."""

    recipe: Recipe
    source: str | Path | Recipe
    out: Path | None
    launcher: Mapping[str, Any]
    resume: Resume
    overrides: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    peak_tflops: float | None = None
    measure: bool = True
    nproc_per_node: int | None = None
    callbacks: tuple = ()
    recipe_callbacks: Callable[[Recipe], Sequence] | None = None
    quiet: bool = False
    wandb: Any = None
    wandb_spec: str | None = None
    join_timeout_s: int | None = None

    @property
    def launched(self) -> bool:
        return bool(self.launcher["launched"])

    def run_dir(self) -> Path:
        return Path(self.out or default_out(self.source))


def wandb_options(spec: str | None):
    """``offline`` / ``online`` / ``mode:project`` (or the parent's :data:`WANDB_ENV`) -> WandbOptions (None: off)."""
    from scaletool.train.metrics import WandbOptions, import_wandb

    spec = spec or os.environ.get(WANDB_ENV) or None
    if spec is None:
        return None
    mode, _, project = spec.partition(":")
    if mode not in ("offline", "online"):
        raise RecipeError(f"wandb {spec!r}: expected offline or online, optionally followed by :PROJECT")
    import_wandb()  # missing: one line now, before anything runs
    return WandbOptions(mode=mode, project=project or "scaletool")


def run_train(req: TrainRequest):
    """The run once its directory is this process's: local ranks, or this process's own rank."""
    from scaletool.engines import check_recipe
    from scaletool.engines.float8 import check_runtime
    from scaletool.measure.count import train_memory_check

    r, le, nproc = req.recipe, req.launcher, req.nproc_per_node
    if not req.launched:  # before any rank builds a model: a run that cannot fit is one line, not an OOM kill
        train_memory_check(r, nproc or 1)
    check_runtime(r)  # train.float8 on a device without FP8, or without torchao: before anything is written
    if nproc is not None and not req.launched:
        if nproc > 1 or engine_kind(r.parallel.engine).distributed:
            if req.callbacks:
                raise RecipeError("callbacks: the ranks of a multi-process run are separate processes; pass "
                                  "callbacks to a run in this process (or to each rank's own train call)")
            return train_local_ranks(req)
    elif nproc is not None and nproc != le["local_world_size"]:
        raise RecipeError(f"nproc_per_node={nproc}: this process is one of {le['local_world_size']} local "
                          "ranks started by a launcher; leave it unset or make them agree")
    check_recipe(r, le["world_size"], le["local_world_size"] if req.launched else None)
    return train_rank(req)


def train_rank(req: TrainRequest):
    """This process's rank of the run: join the process group, train, leave it."""
    import torch.distributed as dist

    from scaletool.engines import agree, init_distributed
    from scaletool.engines.dist import leave_distributed
    from scaletool.errors import describe
    from scaletool.train.summary import failed_result
    from scaletool.train.trainer import Trainer, TrainFailed

    r = req.recipe
    own = list(req.recipe_callbacks(r)) if req.recipe_callbacks is not None else []
    owned = not dist.is_initialized()
    env = init_distributed(r.parallel.engine, r.parallel.collective_timeout_s, req.join_timeout_s)
    try:
        out = Path(agree(str(req.run_dir()), env))
        trainer = None
        try:
            trainer = Trainer(r, out, env, resume=req.resume, peak_tflops=req.peak_tflops, measure=req.measure,
                              quiet=req.quiet, callbacks=[*own, *req.callbacks], wandb=req.wandb)
            return trainer.train()
        except RecipeError:
            raise
        except Exception as e:
            partial = trainer.result if trainer is not None and trainer.result is not None else \
                failed_result(r, out, describe(e))
            raise TrainFailed(partial, [partial.message or describe(e)]) from e
        finally:
            trainer = None  # free the model (DDP's reducer owns the group) while the group is still registered
    finally:
        if owned:
            leave_distributed()


def _rank_inputs(req: TrainRequest, out: Path) -> tuple[str, tuple[str, ...]]:
    """The recipe path and ``--set`` arguments the ranks read: the caller's file with its overrides and the
    package's settings (as JSON values, read back exactly), or a recipe object written to ``out/recipe.yaml``."""
    import yaml

    from scaletool.fmt import write_atomic
    from scaletool.yaml_input import override_text

    if isinstance(req.source, Recipe):  # the ranks read the recipe from a file
        write_atomic(out / "recipe.yaml", yaml.safe_dump(req.recipe.model_dump(mode="json", exclude_unset=True)))
        return str(out / "recipe.yaml"), ()
    return str(req.source), (*req.overrides, *(override_text(k, v) for k, v in req.settings.items()))


def train_local_ranks(req: TrainRequest):
    """Start ``req.nproc_per_node`` local ranks under torchrun (this process is their agent); rank 0's result."""
    from scaletool.engines import check_recipe
    from scaletool.errors import cannot_write
    from scaletool.launch.commands import LaunchSpec, torchrun_argv
    from scaletool.launch.run import run_torchrun
    from scaletool.threads import child_env, threads_per_process
    from scaletool.train.data import make_source
    from scaletool.train.resume import plan_start
    from scaletool.train.trainer import finished_note, say

    r, nproc, out = req.recipe, req.nproc_per_node, req.run_dir()
    check_recipe(r, nproc, nproc)
    make_source(r, 0, nproc)  # a missing or malformed data file fails here, once, before any rank starts
    start = plan_start(out, r.train.steps, req.resume)  # refusals too: before anything starts or is written
    if start.finished is not None:
        if not req.quiet:
            say(finished_note(out, start.finished, r.train.steps))
        return start.finished
    with cannot_write(out, "the run directory"):  # before any rank starts
        out.mkdir(parents=True, exist_ok=True)
        recipe, overrides = _rank_inputs(req, out)
    from scaletool.train.resume import Resume

    flag = {Resume.NEVER: False, Resume.AUTO: "auto", Resume.REQUIRED: True}[req.resume]
    spec = LaunchSpec(recipe, str(out), nproc_per_node=nproc, overrides=overrides, peak_tflops=req.peak_tflops,
                      resume=flag, measure=req.measure)
    env = {TRAIN_CHILD_ENV: "1", **child_env(threads_per_process(nproc)),
           **({WANDB_ENV: req.wandb_spec} if req.wandb_spec else {})}
    started = time.time()
    outcome = run_torchrun(torchrun_argv(spec), env, spec)
    return _rank_zero_verdict(r, out, nproc, outcome, started)


def _rank_zero_verdict(r: Recipe, out: Path, nproc: int, outcome, started: float):
    """Rank 0's summary when the ranks succeeded; else TrainFailed with the ranks' error lines, root cause
    first, and rank 0's partial summary rewritten with the verdict it could not know."""
    import json

    from scaletool.fmt import write_atomic
    from scaletool.results.train import load_train_summary
    from scaletool.train.summary import failed_result
    from scaletool.train.trainer import TrainFailed

    path = out / "summary.json"
    summary = load_train_summary(json.loads(path.read_text()), str(path)) \
        if path.is_file() and path.stat().st_mtime >= started else None
    if outcome.exit_code == 0 and summary is not None:
        return summary
    stop = _stopped_by(outcome)
    if stop is not None:  # the ranks stopped at a step's end, rank 0's summary says where: kept as it is
        from scaletool.train.trainer import Stopped

        partial = summary or failed_result(r, out, f"stopped by {stop.name} before the first step")
        raise TrainFailed(partial, [partial.message or f"stopped by {stop.name}"]) from Stopped(stop)
    lines = [line.removeprefix("error: ") for line in outcome.errors] or [
        f"{nproc}-process run failed (torchrun exit status {outcome.exit_code}); see the log above"]
    partial = (summary or failed_result(r, out, lines[0])).model_copy(
        update={"status": "failed", "message": lines[0], "failures": lines})
    if path.parent.is_dir():  # rank 0's partial summary, with the verdict it could not know
        write_atomic(path, partial.to_json() + "\n")
    raise TrainFailed(partial, lines)


def _stopped_by(outcome):
    """The stop signal (SIGTERM, SIGINT) that ended a local-ranks run, as torchrun's agent reports it, or None."""
    import signal

    sig = outcome.exit_code - 128
    if sig in (signal.SIGTERM, signal.SIGINT) and any(line.startswith("error: stopped by") for line in outcome.errors):
        return signal.Signals(sig)
    return None
