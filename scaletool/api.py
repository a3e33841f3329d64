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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scaletool.config import Recipe, RecipeError, apply_overrides, recipe_from_dict
from scaletool.errors import positive_finite, positive_int
from scaletool.hf import load_recipe
from scaletool.measure.hardware import DEFAULT_HARDWARE

RecipeLike = str | Path | Recipe


def resolve(recipe: RecipeLike, overrides: Sequence[str] = (), settings: Mapping[str, Any] | None = None) -> Recipe:
    """A validated recipe from a path or a :class:`Recipe`, with ``key=value`` overrides (text, as ``--set``
    takes them) and then ``settings`` (dotted key -> value, taken as they are) applied."""
    settings = dict(settings or {})
    if isinstance(recipe, Recipe):
        if not overrides and not settings:
            return recipe
        from scaletool.yaml_input import parse_override

        # what the user gave (inactive keys included), so derived fields are derived again
        raw = apply_overrides(recipe.given(), [parse_override(o) for o in overrides] + list(settings.items()))
        return recipe_from_dict(raw, "recipe")
    if not isinstance(recipe, (str, Path)):
        raise RecipeError(f"recipe: expected a path or a Recipe, got {type(recipe).__name__}")
    return load_recipe(recipe, list(overrides), extra=settings)


def estimate(recipe: RecipeLike, *, overrides: Sequence[str] = (), settings: Mapping[str, Any] | None = None,
             tokens: int | None = None,
             world_size: int | None = None, hardware: str | None = DEFAULT_HARDWARE, inter_node_gb_s: float | None = None,
             gpus_per_node: int | None = None, calibration: str | None = None):
    """The analytic model of ``recipe``: parameters, FLOPs, KV cache, training memory in two phases and,
    on ``hardware`` (a profile name; None: left out), the predicted step per engine (no model built), with
    ``gpus_per_node`` GPUs per node (default all on one node up to 8) and ``inter_node_gb_s`` GB/s of inter-node
    bus bandwidth per GPU (default the calibration's), ``calibration`` a shipped calibration's name or a file's path
    in place of the card's; ``settings``: dotted key -> value, applied after ``overrides``. Returns an
    :class:`~scaletool.results.estimate.EstimateResult`."""
    from scaletool.analytic.estimate import estimate
    from scaletool.results.estimate import EstimateResult

    r = resolve(recipe, overrides, settings)
    est = estimate(r, tokens=tokens, world_size=world_size)
    if r.parallel.pipeline_parallel > 1:  # before any prediction: the stages must divide the GPUs
        from scaletool.kinds.pipeline import pipeline_world_problems

        problems = pipeline_world_problems(r, est["memory"]["world_size"])
        if problems:
            raise RecipeError(problems[0] + " (set --world-size)")
    if hardware is not None:
        from scaletool.predict.prediction import engine_predictions

        est["prediction"] = engine_predictions(r, est["memory"]["world_size"], hardware, inter_node_gb_s, gpus_per_node,
                                               calibration)
    if r.parallel.pipeline_parallel > 1:  # pipeline stages: every memory figure is the largest stage's
        _pipeline_estimate(r, est, hardware)
    return EstimateResult.model_validate(est)


def _pipeline_estimate(r, est: dict, hardware: str | None) -> None:
    """``est`` with the recipe's memory row as its largest pipeline stage's (also a row of the engine table, beside
    the stage's rows without and with full checkpointing) and the ``pipeline`` block
    (:func:`scaletool.analytic.pipeline_time.pipeline_estimate`)."""
    from scaletool.analytic.pipeline_time import pipeline_estimate

    world = est["memory"]["world_size"]
    calib = None
    if hardware is not None:
        from scaletool.measure.hardware import profile_named
        from scaletool.predict.prediction import calibration_for_device

        prof = profile_named(hardware)
        calib = calibration_for_device(prof.device, prof)
    row, block = pipeline_estimate(r, world, calib)
    est["memory"]["recipe"] = row
    # the engine table's columns: the layout's largest stage without and with full checkpointing too
    others = [pipeline_estimate(r.model_copy(update={"train": r.train.model_copy(update={"activation_checkpointing": ac})}),
                                world)[0] for ac in ("none", "full") if ac != r.train.activation_checkpointing]
    est["memory"]["engines"] = [*est["memory"]["engines"], row, *others]
    est["pipeline"] = block


def count(recipe: RecipeLike, *, overrides: Sequence[str] = (), device: str = "meta", batch: int = 1,
          fvcore: bool = True, module_depth: int | None = -1, progress=None):
    """Build ``recipe``'s model on ``device`` (meta: no memory) and measure its parameters and FLOPs
    against the closed forms. On cpu or cuda the memory the count needs is estimated first and a count
    that would not fit is refused (RecipeError) before anything is allocated; so is a device this
    machine does not have. ``module_depth`` (not -1) adds parameters and forward FLOPs per module as a
    tree cut below that depth (None: every module). ``progress(done, total, description)`` hears of each
    stage. Returns a :class:`~scaletool.results.count.CountResult`."""
    from scaletool.measure.count import count as measure
    from scaletool.results.count import CountResult

    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise RecipeError(f"batch: expected a positive number of sequences, got {str(batch)[:40]!r}")
    return CountResult.model_validate(measure(resolve(recipe, overrides), device=device, batch=batch, fvcore=fvcore,
                                              module_depth=module_depth, progress=progress))


def report(results_dirs: Sequence[str | Path], out: str | Path | None = None):
    """Write the report of one or more sweep results directories into ``out`` (default
    ``<first dir>/report``) and return its :class:`~scaletool.results.report.ReportResult`."""
    from scaletool.report.render import build_report

    dirs = [Path(d) for d in results_dirs]
    if not dirs:
        raise RecipeError("report: no results directory given")
    return build_report(dirs, Path(out) if out is not None else dirs[0] / "report")


def hardware(device_name: str | None = None):
    """The accelerator profiles (user profiles first) and the one this machine matches: its first CUDA
    device's name (``torch.cuda.get_device_name``) or, without CUDA, the CPU. ``device_name`` asks
    about a GPU by name instead (``"cpu"`` for a CPU). Returns a :class:`~scaletool.results.hardware.HardwareResult`."""
    from scaletool.measure.hardware import load_profiles, profile_for, user_dirs
    from scaletool.results.hardware import HardwareResult, ThisMachine

    profiles = load_profiles()
    if device_name is not None:
        device, count = ("cpu" if device_name.strip().lower() == "cpu" else "cuda"), None
    else:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = "cuda" if count else "cpu"
        device_name = torch.cuda.get_device_name(0) if count else "cpu"
    prof = profile_for(device, device_name, profiles)
    return HardwareResult(profiles=profiles, user_dirs=[str(d) for d in user_dirs()],
                          this_machine=ThisMachine(device=device, device_name=device_name, device_count=count,
                                                   profile=prof.name if prof else None))


def plan(recipe: RecipeLike, *, gpus: int, overrides: Sequence[str] = (), gpus_per_node: int | None = None,
         hardware: str = DEFAULT_HARDWARE, global_batch_tokens: int | None = None, seq_len: int | None = None,
         price_per_gpu_hour: float | None = None, attention_variants: bool = False, top: int = 5, verify: int = 0,
         progress=None, verify_progress=None, inter_node_gb_s: float | None = None, calibration: str | None = None,
         verify_out: str | Path | None = None):
    """The layouts of ``recipe`` on ``gpus`` GPUs of ``hardware`` that fit, ranked by predicted tokens/s,
    each with its ``scaletool launch`` command; ``verify`` K runs the best K that fit this machine for a
    few steps and sets measured beside predicted. Returns a :class:`~scaletool.results.plan.PlanResult`.
    ``progress(done, total)`` is called during the search, ``verify_progress(line)`` before each run and with
    its outcome after it.
    ``inter_node_gb_s``: the bus bandwidth per GPU across nodes (GB/s), in place of the calibration's;
    ``calibration``: a shipped calibration's name or a file's path, in place of the card's; ``verify_out``: a new
    or empty directory the verified runs stay in (one per layout), else they go to a temporary one."""
    from scaletool.analytic.calibration import load_calibration
    from scaletool.plan.build import make_plan, make_request
    from scaletool.results.plan import PlanResult
    from scaletool.yaml_input import override_text

    settings = {} if seq_len is None else {"train.seq_len": positive_int("seq_len", seq_len)}
    r = resolve(recipe, overrides, settings)
    # the launch commands the plan prints carry the settings too, as --set arguments read back exactly
    overrides = (*overrides, *(override_text(k, v) for k, v in settings.items()))
    req = make_request(gpus, gpus_per_node, hardware, global_batch_tokens=global_batch_tokens,
                       price_per_gpu_hour=price_per_gpu_hour, attention_variants=attention_variants, top=top,
                       inter_node_gb_s=inter_node_gb_s,
                       calibration=load_calibration(calibration) if calibration else None)
    if verify < 0:
        raise RecipeError(f"verify: {verify}: give the number of layouts to run (0: none)")
    if verify_out is not None and not verify:
        raise RecipeError("--verify-out needs --verify K: it keeps the runs --verify makes")
    name = str(recipe) if isinstance(recipe, (str, Path)) else "recipe.yaml"
    result = make_plan(r, name, tuple(overrides), req, progress)
    if verify:
        from scaletool.plan.verify import prepare_keep_dir, verify_locally

        keep = prepare_keep_dir(Path(verify_out)) if verify_out is not None else None
        result["verify"], result["verify_notes"] = verify_locally(r, name, tuple(overrides), verify, verify_progress,
                                                                  asked=req, keep=keep)
    return PlanResult.model_validate(result)


def load_sweep(sweep_file: str | Path, overrides: Sequence[str] = ()):
    """A validated :class:`~scaletool.sweep.spec.Sweep` from its file, ``key=value`` overrides applied to every point."""
    from scaletool.sweep import spec
    from scaletool.yaml_input import parse_override

    return spec.load_sweep(sweep_file, [parse_override(o) for o in overrides])


def sweep_results_dir(sweep, out: str | Path | None = None) -> Path:
    """Where a sweep writes: ``out``, else ``runs/sweeps/<the sweep's name as a safe slug>``."""
    return Path(out) if out is not None else Path("runs") / "sweeps" / sweep.dirname


def _check_modes(sw, modes: Sequence[str]) -> list[str]:
    bad = [m for m in modes if m not in sw.spec.modes]
    if bad:
        raise RecipeError(f"modes: {', '.join(bad)} not among the sweep's modes ({', '.join(sw.spec.modes)})")
    return list(modes)


def sweep(sweep_file: str | Path, *, out: str | Path | None = None, overrides: Sequence[str] = (),
          modes: Sequence[str] = (), retry_failed: bool = False, parallel: int = 1, gpus: str | None = None,
          console=None):
    """Run a sweep file's missing runs (see ``scaletool sweep --help``); returns its
    :class:`~scaletool.results.sweep.SweepSummary`. ``parallel`` runs at once, each on its own cores
    (and GPUs: ``gpus`` such as ``"0,1,2,3"``, else the visible ones). Stopping it (KeyboardInterrupt,
    SIGTERM) kills every process its runs started; rerunning resumes."""
    from scaletool.sweep.runner import execute

    if parallel < 1:
        raise RecipeError(f"parallel: must be at least 1, got {parallel}")
    sw = load_sweep(sweep_file, overrides)
    return execute(sw, sweep_results_dir(sw, out), retry_failed=retry_failed, modes=_check_modes(sw, modes),
                   parallel=parallel, gpus=gpus, console=console)


def sweep_plan(sweep_file: str | Path, *, out: str | Path | None = None, overrides: Sequence[str] = (),
               modes: Sequence[str] = (), retry_failed: bool = False):
    """What :func:`sweep` would run, against what its results directory holds; writes nothing.
    Returns a :class:`~scaletool.results.sweep.SweepPlan`."""
    from scaletool.results.sweep import PlannedRun, SweepPlan
    from scaletool.sweep.runner import gpus_needed, plan, select, to_run

    sw = load_sweep(sweep_file, overrides)
    results_dir = sweep_results_dir(sw, out)
    tasks, warnings = plan(sw, results_dir)
    chosen = select(tasks, _check_modes(sw, modes))
    runs = {t.key for t in to_run(chosen, retry_failed)}
    rows = [PlannedRun(task=t.n, index=t.point.index, label=t.point.label, mode=t.mode, repeat=t.repeat,
                       repeats=t.repeats, key=t.key, state=t.state, will_run=t.key in runs and t.state != "skipped",
                       previous_status=t.previous.status if t.previous else None, reason=t.point.reason,
                       match_params=t.point.match_params, point_dir=t.point.dirname,
                       gpus_needed=gpus_needed(sw, t.mode, t.args)) for t in chosen]
    return SweepPlan(sweep=sw.name, results_dir=str(results_dir), warnings=warnings, runs=rows)


def sweep_submit(sweep_file: str | Path, *, out: str | Path | None = None, overrides: Sequence[str] = (),
                 modes: Sequence[str] = (), retry_failed: bool = False, dry_run: bool = False,
                 time: str | None = None, partition: str | None = None, account: str | None = None,
                 gpus_per_node: int | None = None, cpus_per_task: int | None = None, throttle: int | None = None):
    """Submit a sweep's missing runs as a Slurm job array (``dry_run``: the script as text, nothing written).
    Returns a :class:`~scaletool.results.sweep.SweepSubmission`, or None when nothing is missing."""
    from scaletool.launch.slurm import SlurmOptions
    from scaletool.sweep.slurm import submit_sweep

    sw = load_sweep(sweep_file, overrides)
    opts = SlurmOptions(time=time, partition=partition, account=account, gpus_per_node=gpus_per_node,
                        cpus_per_task=cpus_per_task)
    return submit_sweep(sw, sweep_results_dir(sw, out), overrides=list(overrides), modes=_check_modes(sw, modes),
                        retry_failed=retry_failed, opts=opts, throttle=throttle, dry_run=dry_run)


def decode(recipe: RecipeLike, *, overrides: Sequence[str] = (), contexts: Sequence[int] | None = None,
           batch: int | str | Sequence[int | str] = 1, new_tokens: int = 32, device: str | None = None,
           dtype: str | None = None, mla_mode: str | None = None, mla_kernel: str = "auto",
           cuda_graph: bool | None = None, memory_budget_gib: float | None = None, checkpoint: str | Path | None = None,
           trust_checkpoint: bool = False, seed: int = 0, prefill_chunk: int = 4096, warmup_steps: int = 3,
           prefill_repeats: int = 3, compile: bool = False, compile_tuning: bool = False, gemv: bool | None = None,
           split_batch: int = 1, join_projections: bool = True, pdl: bool | None = None, progress=None):
    """Prefill and decode ``recipe``'s model at each (context, batch); a :class:`~scaletool.results.decode.DecodeResult`.

    ``batch``: an int, 'max' (the largest batch whose weights + KV cache fit the memory budget, by
    the analytic fit) or a sequence of them (``[1, "max"]``). ``device``: 'cuda' or 'cpu' (default:
    cuda when available). ``mla_mode``: MLA's decode algorithm (``scaletool.kinds.attention.MLA_MODES``;
    default: absorbed, expand for ``mla_rope=per_head``). ``cuda_graph``: replay each decode step from a
    CUDA graph (default: on for CUDA). ``compile``: run the step through ``torch.compile`` (static shapes,
    one compile per point), captured in the CUDA graph when that is on; ``compile_tuning``, ``gemv``,
    ``split_batch``, ``join_projections`` and ``pdl``: ``scaletool decode``'s ``--compile-tuning``, ``--gemv``,
    ``--split-batch``, ``--join-projections`` and ``--pdl`` (``pdl`` None: on where the GPU has it; ``gemv``
    None: on with PDL and ``compile``).
    ``memory_budget_gib``: for 'max' and the fit table (default: the GPU's memory; none on CPU).
    ``checkpoint``: a ``scaletool train`` checkpoint directory (default: random weights from ``seed``).
    ``progress(done, total, description, detail=None)`` hears of building the model (``total`` None) and of
    each point, and of the parts of a point (fractional ``done``). A run whose weights and largest cache
    exceed the memory available is refused before anything is allocated (:func:`scaletool.decode.setup.prepare`).
    """
    from scaletool.decode.bench import run_decode
    from scaletool.decode.setup import announce_build, decode_model, prepare

    r = resolve(recipe, overrides, {"model.dtype": dtype} if dtype else None)
    setup = prepare(r.model, contexts=contexts, batch=batch, new_tokens=new_tokens, device=device, mla_mode=mla_mode,
                    mla_kernel=mla_kernel, cuda_graph=cuda_graph, memory_budget_gib=memory_budget_gib, seed=seed,
                    prefill_chunk=prefill_chunk, warmup_steps=warmup_steps, prefill_repeats=prefill_repeats,
                    compile=compile, compile_tuning=compile_tuning, gemv=gemv, split_batch=split_batch,
                    join_projections=join_projections, pdl=pdl)
    if checkpoint is not None:  # a damaged or unsafe checkpoint is refused before the model is built
        from scaletool.train.checkpoint import check_loadable

        check_loadable(checkpoint, trust_checkpoint=trust_checkpoint)
    threads = None
    if setup.device.type == "cpu":
        from scaletool.threads import pin_threads

        threads = pin_threads()
    if progress is not None:
        announce_build(progress, r.model, setup.device, checkpoint is not None)
    model = decode_model(r, setup.device, seed, checkpoint_weights(checkpoint, trust_checkpoint))
    res = run_decode(r.model, model, setup.settings, budget_bytes=setup.budget_bytes, progress=progress)
    return res.model_copy(update={"recipe": str(recipe) if isinstance(recipe, (str, Path)) else None,
                                  "checkpoint": None if checkpoint is None else str(checkpoint), "threads": threads})


def checkpoint_weights(checkpoint: str | Path | None, trust_checkpoint: bool = False):
    """A loader putting a ``scaletool train`` checkpoint's weights into a model (None: no checkpoint), for
    :func:`scaletool.decode.setup.decode_model`."""
    if checkpoint is None:
        return None

    def load(model):
        from scaletool.train.checkpoint import load_model_weights

        return load_model_weights(checkpoint, model, trust_checkpoint=trust_checkpoint)

    return load


# -------------------------------------------------------------------------------------------------
# train and profile


def train(recipe: RecipeLike, *, overrides: Sequence[str] = (), settings: Mapping[str, Any] | None = None,
          out: str | Path | None = None, resume: str | bool = "never", peak_tflops: float | None = None,
          measure: bool = True, nproc_per_node: int | None = None, callbacks: Sequence = (), quiet: bool = False,
          wandb: str | None = None, join_timeout_s: int | None = None):
    """Train ``recipe`` and return its :class:`~scaletool.results.train.TrainResult` (also ``<out>/summary.json``).

    Runs in this process (one rank, or a rank of torchrun or the DeepSpeed launcher), or, with
    ``nproc_per_node`` N outside a launcher, starts N local ranks under torchrun and returns rank 0's
    result (:func:`scaletool.train.run.run_train`). ``settings``: dotted key -> value, applied after
    ``overrides``. ``resume``: ``never`` (a run directory holding a run is refused), ``auto`` (continue from
    the newest intact checkpoint when there is one) or ``required``. ``callbacks``
    (:class:`scaletool.train.callbacks.Callback`) run in this process, after the recipe's profiler and
    monitors. ``wandb``: ``offline`` or ``online`` (optionally ``mode:project``) logs to Weights & Biases.
    ``join_timeout_s``: under a launcher without a rendezvous of its own (the DeepSpeed launcher), fail
    with :class:`~scaletool.errors.JoinError` when the ranks have not all met at MASTER_ADDR:MASTER_PORT
    within this many seconds, instead of waiting the group's whole timeout.

    A diverged run returns its result (``status == "diverged"``); a run stopped by an exception, a
    signal or a failed rank raises :class:`~scaletool.train.trainer.TrainFailed`, whose ``result``
    holds what was measured and whose ``lines`` say what failed, root cause first.
    """
    from scaletool.engines import launcher_env
    from scaletool.profile import recipe_callbacks
    from scaletool.train.resume import Resume
    from scaletool.train.run import TrainRequest, run_train, wandb_options

    settings = dict(settings or {})
    req = TrainRequest(recipe=resolve(recipe, overrides, settings), source=recipe, out=None if out is None else Path(out),
                       launcher=launcher_env(), overrides=tuple(overrides), settings=settings,
                       resume=Resume.parse(resume), peak_tflops=positive_finite("peak_tflops", peak_tflops),
                       measure=measure, nproc_per_node=nproc_per_node, callbacks=tuple(callbacks), quiet=quiet,
                       recipe_callbacks=recipe_callbacks,
                       wandb=wandb_options(wandb), wandb_spec=wandb,
                       join_timeout_s=None if join_timeout_s is None else positive_int("join_timeout_s", join_timeout_s))
    if req.launched:
        return run_train(req)
    # the top of the run (alone, or the parent of local ranks): one run per directory
    from dataclasses import replace

    from scaletool.sweep.lock import run_lock

    req = replace(req, out=req.run_dir())
    with run_lock(req.out, what=f"scaletool train {recipe if isinstance(recipe, (str, Path)) else '(a recipe object)'}"):
        return run_train(req)


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

    settings: dict[str, Any] = {"profile.enabled": True}
    if ranks is not None:
        settings["profile.ranks"] = ranks if isinstance(ranks, str) else list(ranks)
    if monitors is not None:
        settings["profile.monitors.enabled"] = bool(monitors)
    r = resolve(recipe, overrides, settings)  # bad recipes fail here, once, before anything starts
    world = nproc_per_node or launcher_env()["world_size"]
    if r.profile.ranks != "all" and max(r.profile.ranks) >= world:
        raise RecipeError(f"profile.ranks: {r.profile.ranks} names ranks beyond the world size {world}")
    from scaletool.train.run import default_out

    out = Path(out or default_out(recipe))
    result = train(recipe, overrides=overrides, settings=settings, out=out, nproc_per_node=nproc_per_node, quiet=quiet)
    if launcher_env()["rank"] != 0:
        return None
    if result.status != "completed":
        raise TrainFailed(result, [result.message or result.status])
    path = profile_dir(out) / BREAKDOWN_FILE
    if not path.is_file():
        raise RecipeError(f"{path}: no breakdown was written (see {out / 'train.log'})")
    return load_breakdown(json.loads(path.read_text()), str(path))
