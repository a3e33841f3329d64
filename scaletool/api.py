"""The library under the CLI: one function per command, each taking a recipe and options and
returning that command's result.

``scaletool.cli`` parses arguments and calls these; a notebook or another tool calls them directly::

    from scaletool import api
    est = api.estimate("recipes/mla-1b.yaml", overrides=["model.kv_lora_rank=256"])

A recipe argument is a path, or an already validated :class:`~scaletool.config.Recipe`. Library
functions raise :class:`~scaletool.errors.RecipeError` for input they cannot use (one line per
problem) and never name CLI flags in their messages. Heavy modules (torch) are imported inside the
functions that need them, so importing this module stays cheap.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from scaletool.config import Recipe, RecipeError, apply_overrides, load_recipe, recipe_from_dict

RecipeLike = str | Path | Recipe


def resolve(recipe: RecipeLike, overrides: Sequence[str] = ()) -> Recipe:
    """A validated recipe from a path or a :class:`Recipe`, with ``key=value`` overrides applied."""
    if isinstance(recipe, Recipe):
        if not overrides:
            return recipe
        from scaletool.config import parse_override

        raw = apply_overrides(recipe.model_dump(mode="json", exclude_unset=True),
                              [parse_override(o) for o in overrides])
        return recipe_from_dict(raw, "recipe")
    if not isinstance(recipe, (str, Path)):
        raise RecipeError(f"recipe: expected a path or a Recipe, got {type(recipe).__name__}")
    return load_recipe(recipe, list(overrides))


def estimate(recipe: RecipeLike, *, overrides: Sequence[str] = (), tokens: int | None = None,
             world_size: int | None = None) -> dict:
    """The analytic model of ``recipe``: parameters, FLOPs, KV cache and training memory (no model built)."""
    from scaletool import analytic

    return analytic.estimate(resolve(recipe, overrides), tokens=tokens, world_size=world_size)


# -------------------------------------------------------------------------------------------------
# train and profile

#: set by a parent that starts local ranks for their process: they write summary.json and leave the
#: verdict (exit status, error lines, --json output) to the parent
TRAIN_CHILD_ENV = "SCALETOOL_TRAIN_CHILD"
#: ``mode[:project]`` of Weights & Biases logging, how a parent hands it to the ranks it starts
WANDB_ENV = "SCALETOOL_WANDB"


def default_out(recipe: RecipeLike) -> Path:
    """``runs/<recipe name>-<timestamp>``."""
    import time

    stem = Path(recipe).stem if isinstance(recipe, (str, Path)) else "train"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def train(recipe: RecipeLike, *, overrides: Sequence[str] = (), out: str | Path | None = None,
          resume: str | bool = "never", peak_tflops: float | None = None, measure: bool = True,
          nproc_per_node: int | None = None, callbacks: Sequence = (), quiet: bool = False,
          wandb: str | None = None):
    """Train ``recipe`` and return its :class:`~scaletool.results.train.TrainResult` (also ``<out>/summary.json``).

    Runs in this process (one rank, or a rank of torchrun or the DeepSpeed launcher), or, with
    ``nproc_per_node`` N outside a launcher, starts N local ranks under torchrun and returns rank 0's
    result. ``resume``: ``never`` (a run directory holding a run is refused), ``auto`` (continue from
    the newest intact checkpoint when there is one) or ``required``. ``callbacks``
    (:class:`scaletool.train.callbacks.Callback`) run in this process, after the recipe's profiler and
    monitors. ``wandb``: ``offline`` or ``online`` (optionally ``mode:project``) logs to Weights & Biases.

    A diverged run returns its result (``status == "diverged"``); a run stopped by an exception, a
    signal or a failed rank raises :class:`~scaletool.train.trainer.TrainFailed`, whose ``result``
    holds what was measured and whose ``lines`` say what failed, root cause first.
    """
    from scaletool.engines import check_recipe, launcher_env
    from scaletool.train.resume import Resume

    r = resolve(recipe, overrides)
    resume = Resume.parse(resume)
    options = _wandb_options(wandb)
    le = launcher_env()
    if nproc_per_node is not None and not le["launched"]:
        if nproc_per_node > 1 or r.parallel.engine != "single":
            if callbacks:
                raise RecipeError("callbacks: the ranks of a multi-process run are separate processes; pass "
                                  "callbacks to a run in this process (or to each rank's own train call)")
            return _train_local_ranks(recipe, overrides, r, nproc_per_node, Path(out or default_out(recipe)), resume,
                                      peak_tflops, measure, wandb, quiet)
    elif nproc_per_node is not None and nproc_per_node != le["local_world_size"]:
        raise RecipeError(f"nproc_per_node={nproc_per_node}: this process is one of {le['local_world_size']} local "
                          "ranks started by a launcher; leave it unset or make them agree")
    check_recipe(r, le["world_size"], le["local_world_size"] if le["launched"] else None)
    return _train_rank(r, recipe, out, resume, peak_tflops, measure, callbacks, quiet, options)


def _wandb_options(spec: str | None):
    """``offline`` / ``online`` / ``mode:project`` (or the parent's :data:`WANDB_ENV`) -> WandbOptions."""
    import os

    from scaletool.measure.metrics import WandbOptions, import_wandb

    spec = spec or os.environ.get(WANDB_ENV) or None
    if spec is None:
        return None
    mode, _, project = spec.partition(":")
    if mode not in ("offline", "online"):
        raise RecipeError(f"wandb {spec!r}: expected offline or online, optionally followed by :PROJECT")
    import_wandb()  # missing: one line now, before anything runs
    return WandbOptions(mode=mode, project=project or "scaletool")


def _train_rank(r: Recipe, recipe: RecipeLike, out, resume, peak_tflops, measure, callbacks, quiet, wandb):
    """This process's rank of the run: join the process group, train, leave it."""
    import torch.distributed as dist

    from scaletool.engines import agree, init_distributed
    from scaletool.errors import describe
    from scaletool.profile import recipe_callbacks
    from scaletool.train.summary import failed_result
    from scaletool.train.trainer import Trainer, TrainFailed

    owned = not dist.is_initialized()
    env = init_distributed(r.parallel.engine, r.parallel.collective_timeout_s)
    try:
        out = Path(agree(str(out or default_out(recipe)), env))
        trainer = None
        try:
            trainer = Trainer(r, out, env, resume=resume, peak_tflops=peak_tflops, measure=measure, quiet=quiet,
                              callbacks=[*recipe_callbacks(r), *callbacks], wandb=wandb)
            return trainer.train()
        except RecipeError:
            raise
        except Exception as e:
            partial = trainer.result if trainer is not None and trainer.result is not None else \
                failed_result(r, out, describe(e))
            raise TrainFailed(partial, [partial.message or describe(e)]) from e
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _train_local_ranks(recipe: RecipeLike, overrides: Sequence[str], r: Recipe, nproc: int, out: Path, resume,
                       peak_tflops, measure: bool, wandb: str | None, quiet: bool):
    """Start ``nproc`` local ranks under torchrun (this process is their agent); rank 0's result."""
    import json
    import os
    import time

    import yaml

    from scaletool.engines import check_recipe
    from scaletool.launch.commands import LaunchSpec, torchrun_argv
    from scaletool.launch.run import run_torchrun
    from scaletool.results.train import load_train_summary
    from scaletool.threads import child_env, threads_per_process
    from scaletool.train.data import make_source
    from scaletool.train.resume import Resume, plan_start
    from scaletool.train.summary import failed_result
    from scaletool.train.trainer import TrainFailed, finished_note, say

    check_recipe(r, nproc, nproc)
    make_source(r, 0, nproc)  # a missing or malformed data file fails here, once, before any rank starts
    start = plan_start(out, r.train.steps, resume)  # refusals too: before anything starts or is written
    if start.finished is not None:
        if not quiet:
            say(finished_note(out, start.finished, r.train.steps))
        return start.finished
    if isinstance(recipe, Recipe):  # the ranks read the recipe from a file
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json", exclude_unset=True)))
        recipe, overrides = out / "recipe.yaml", ()
    flag = {Resume.NEVER: False, Resume.AUTO: "auto", Resume.REQUIRED: True}[resume]
    spec = LaunchSpec(str(recipe), str(out), nproc_per_node=nproc, overrides=tuple(overrides), peak_tflops=peak_tflops,
                      resume=flag, measure=measure)
    env = {TRAIN_CHILD_ENV: "1", **child_env(threads_per_process(nproc)), **({WANDB_ENV: wandb} if wandb else {})}
    started = time.time()
    outcome = run_torchrun(torchrun_argv(spec), env, spec)
    path = out / "summary.json"
    summary = load_train_summary(json.loads(path.read_text()), str(path)) \
        if path.is_file() and path.stat().st_mtime >= started else None
    if outcome.exit_code == 0 and summary is not None:
        return summary
    lines = [line.removeprefix("error: ") for line in outcome.errors] or [
        f"{nproc}-process run failed (torchrun exit status {outcome.exit_code}); see the log above"]
    partial = (summary or failed_result(r, out, lines[0])).model_copy(
        update={"status": "failed", "message": lines[0], "failures": lines})
    if path.parent.is_dir():  # rank 0's partial summary, with the verdict it could not know
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(partial.to_json() + "\n")
        os.replace(tmp, path)
    raise TrainFailed(partial, lines)


def profile(recipe: RecipeLike, *, overrides: Sequence[str] = (), out: str | Path | None = None,
            ranks: str | Sequence[int] | None = None, monitors: bool | None = None,
            nproc_per_node: int | None = None, quiet: bool = False):
    """Train ``recipe`` with ``torch.profiler`` on (and optionally the training-dynamics monitors) and
    return the operator breakdown, a :class:`~scaletool.results.profile.ProfileResult` (None on ranks
    other than 0 of a launched run). ``ranks``: ``"all"`` or the ranks that profile."""
    import json

    from scaletool.engines import launcher_env
    from scaletool.profile.trace import BREAKDOWN_FILE, profile_dir
    from scaletool.results.profile import load_breakdown
    from scaletool.train.trainer import TrainFailed

    extra = ["profile.enabled=true"]
    if ranks is not None:
        extra.append(f"profile.ranks={ranks if isinstance(ranks, str) else '[' + ','.join(map(str, ranks)) + ']'}")
    if monitors is not None:
        extra.append(f"profile.monitors.enabled={str(monitors).lower()}")
    overrides = [*overrides, *extra]
    r = resolve(recipe, overrides)  # bad recipes fail here, once, before anything starts
    world = nproc_per_node or launcher_env()["world_size"]
    if r.profile.ranks != "all" and max(r.profile.ranks) >= world:
        raise RecipeError(f"profile.ranks: {r.profile.ranks} names ranks beyond the world size {world}")
    out = Path(out or default_out(recipe))
    result = train(recipe, overrides=overrides, out=out, nproc_per_node=nproc_per_node, quiet=quiet)
    if launcher_env()["rank"] != 0:
        return None
    if result.status != "completed":
        raise TrainFailed(result, [result.message or result.status])
    path = profile_dir(out) / BREAKDOWN_FILE
    if not path.is_file():
        raise RecipeError(f"{path}: no breakdown was written (see {out / 'train.log'})")
    return load_breakdown(json.loads(path.read_text()), str(path))
