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

from scaletool.config import Recipe, RecipeError, apply_overrides, recipe_from_dict
from scaletool.hf import load_recipe
from scaletool.kinds.engines import engine_kind
from scaletool.measure.hardware import DEFAULT_HARDWARE

RecipeLike = str | Path | Recipe


def resolve(recipe: RecipeLike, overrides: Sequence[str] = ()) -> Recipe:
    """A validated recipe from a path or a :class:`Recipe`, with ``key=value`` overrides applied."""
    if isinstance(recipe, Recipe):
        if not overrides:
            return recipe
        from scaletool.yaml_input import parse_override

        # what the user gave (inactive keys included), so derived fields are derived again
        raw = apply_overrides(recipe.given(), [parse_override(o) for o in overrides])
        return recipe_from_dict(raw, "recipe")
    if not isinstance(recipe, (str, Path)):
        raise RecipeError(f"recipe: expected a path or a Recipe, got {type(recipe).__name__}")
    return load_recipe(recipe, list(overrides))


def estimate(recipe: RecipeLike, *, overrides: Sequence[str] = (), tokens: int | None = None,
             world_size: int | None = None, hardware: str | None = DEFAULT_HARDWARE, inter_node_gb_s: float | None = None,
             gpus_per_node: int | None = None, calibration: str | None = None):
    """The analytic model of ``recipe``: parameters, FLOPs, KV cache, training memory in two phases and,
    on ``hardware`` (a profile name; None: left out), the predicted step per engine (no model built), with
    ``gpus_per_node`` GPUs per node (default all on one node up to 8) and ``inter_node_gb_s`` GB/s of inter-node
    bus bandwidth per GPU (default the calibration's), ``calibration`` a shipped calibration's name or a file's path
    in place of the card's. Returns an :class:`~scaletool.results.estimate.EstimateResult`."""
    from scaletool.analytic.estimate import estimate
    from scaletool.results.estimate import EstimateResult

    r = resolve(recipe, overrides)
    est = estimate(r, tokens=tokens, world_size=world_size)
    if r.parallel.pipeline_parallel > 1:  # before any prediction: the stages must divide the GPUs
        from scaletool.kinds.pipeline import pipeline_world_problems

        problems = pipeline_world_problems(r, est["memory"]["world_size"])
        if problems:
            raise RecipeError(problems[0] + " (set --world-size)")
    if hardware is not None:
        from scaletool.measure.prediction import engine_predictions

        est["prediction"] = engine_predictions(r, est["memory"]["world_size"], hardware, inter_node_gb_s, gpus_per_node,
                                               calibration)
    if r.parallel.pipeline_parallel > 1:  # pipeline stages: every memory figure is the largest stage's
        _pipeline_estimate(r, est, hardware)
    return EstimateResult.model_validate(est)


def _pipeline_estimate(r, est: dict, hardware: str | None) -> None:
    """``est`` with the recipe's memory row as its largest pipeline stage's (also a row of the engine table) and
    the ``pipeline`` block (:func:`scaletool.analytic.pipeline.pipeline_estimate`)."""
    from scaletool.analytic.pipeline import pipeline_estimate

    world = est["memory"]["world_size"]
    calib = None
    if hardware is not None:
        from scaletool.measure.hardware import profile_named
        from scaletool.measure.prediction import calibration_for_device

        prof = profile_named(hardware)
        calib = calibration_for_device(prof.device, prof)
    row, block = pipeline_estimate(r, world, calib)
    est["memory"]["recipe"] = row
    est["memory"]["engines"] = [*est["memory"]["engines"], row]
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
         progress=None, verify_progress=None, inter_node_gb_s: float | None = None, calibration: str | None = None):
    """The layouts of ``recipe`` on ``gpus`` GPUs of ``hardware`` that fit, ranked by predicted tokens/s,
    each with its ``scaletool launch`` command; ``verify`` K runs the best K that fit this machine for a
    few steps and sets measured beside predicted. Returns a :class:`~scaletool.results.plan.PlanResult`.
    ``progress(done, total)`` is called during the search, ``verify_progress(line)`` before each run.
    ``inter_node_gb_s``: the bus bandwidth per GPU across nodes (GB/s), in place of the calibration's;
    ``calibration``: a shipped calibration's name or a file's path, in place of the card's."""
    from scaletool.analytic.calibration import load_calibration
    from scaletool.plan.build import make_plan, make_request
    from scaletool.results.plan import PlanResult

    if seq_len is not None:
        overrides = (*overrides, f"train.seq_len={_positive('seq_len', seq_len)}")
    r = resolve(recipe, overrides)
    req = make_request(gpus, gpus_per_node, hardware, global_batch_tokens=global_batch_tokens,
                       price_per_gpu_hour=price_per_gpu_hour, attention_variants=attention_variants, top=top,
                       inter_node_gb_s=inter_node_gb_s,
                       calibration=load_calibration(calibration) if calibration else None)
    if verify < 0:
        raise RecipeError(f"verify: {verify}: give the number of layouts to run (0: none)")
    name = str(recipe) if isinstance(recipe, (str, Path)) else "recipe.yaml"
    result = make_plan(r, name, tuple(overrides), req, progress)
    if verify:
        from scaletool.plan.verify import verify_locally

        result["verify"], result["verify_notes"] = verify_locally(r, name, tuple(overrides), verify, verify_progress,
                                                                  asked=req)
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


def _batches(batch) -> tuple[int | None, ...]:
    """``batch`` as a tuple of positive ints and None ('max'): an int, 'max', or a sequence of them."""
    items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    out = []
    for b in items:
        if b is None or b == "max":
            out.append(None)
        elif isinstance(b, int) and not isinstance(b, bool) and b > 0:
            out.append(b)
        else:
            raise RecipeError(f"batch: {str(b)[:40]!r} is neither a positive integer nor 'max'")
    if not out:
        raise RecipeError("batch: give at least one batch size")
    return tuple(out)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{name}: expected a positive integer, got {str(value)[:40]!r}")
    return value


def _positive_finite(name: str, value: float | None) -> float | None:
    """None, or a finite number > 0 (a NaN or infinite peak or budget would pass every comparison)."""
    import math

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RecipeError(f"{name}: expected a finite number > 0, got {str(value)[:40]!r}")
    return float(value)


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
    exceed the memory available is refused before anything is allocated.
    """
    import torch

    from scaletool.decode.bench import DecodeSettings, plan_points, run_decode
    from scaletool.decode.generate import require_lm
    from scaletool.decode.sizing import cache_bytes_per_token, check_memory, memory_fit
    from scaletool.kinds.attention import attention_kind, position_kind
    from scaletool.model.attention import DecodeMode

    r = resolve(recipe, [*overrides, *([f"model.dtype={dtype}"] if dtype else [])])
    cfg = r.model
    require_lm(cfg)
    try:
        mode = DecodeMode(attention_kind(cfg).resolve_mode(cfg, mla_mode), mla_kernel)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    dev = _decode_device(device)
    _check_decode_paths(cfg, mode, dev, cuda_graph=cuda_graph, compile=compile, split_batch=split_batch)
    contexts = tuple(_positive("context", n) for n in (contexts or (cfg.max_seq_len,)))
    pdl, gemv = _launch_defaults(dev, pdl, gemv, compile)
    s = DecodeSettings(batches=_batches(batch), contexts=contexts, new_tokens=_positive("new_tokens", new_tokens),
                       mode=mode, cuda_graph=dev.type == "cuda" if cuda_graph is None else cuda_graph,
                       compile=bool(compile), compile_tuning=bool(compile_tuning), gemv=bool(gemv),
                       join=bool(join_projections), pdl=bool(pdl),
                       split=_positive("split_batch", split_batch),
                       prefill_chunk=_positive("prefill_chunk", prefill_chunk),
                       warmup_steps=_positive("warmup_steps", warmup_steps),
                       prefill_repeats=_positive("prefill_repeats", prefill_repeats), seed=seed)
    longest = max(contexts) + s.extra_positions
    if not position_kind(cfg).extrapolates and longest > cfg.max_seq_len:
        raise RecipeError(f"context: position_encoding=learned has a table of model.max_seq_len={cfg.max_seq_len} "
                          f"positions, and the longest point needs {longest} (context {max(contexts)} + "
                          f"{s.warmup_steps} warm-up + {s.new_tokens} new tokens); a learned table cannot grow")
    memory_budget_gib = _positive_finite("memory_budget_gib", memory_budget_gib)
    budget = int(memory_budget_gib * 2**30) if memory_budget_gib else (
        torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None)
    fit = None if budget is None else memory_fit(cfg, budget, s.contexts, s.extra_positions)
    largest = max(b * (n + s.extra_positions) for n, b in plan_points(cfg, s, fit))
    check_memory(cfg, largest * cache_bytes_per_token(cfg, mode.mla), dev)
    if checkpoint is not None:  # a damaged or unsafe checkpoint is refused before the model is built
        from scaletool.train.checkpoint import check_loadable

        check_loadable(checkpoint, trust_checkpoint=trust_checkpoint)
    threads = None
    if dev.type == "cpu":
        from scaletool.threads import pin_threads

        threads = pin_threads()
    if progress is not None:
        _announce_build(progress, cfg, dev, checkpoint)
    model = _decode_model(r, dev, seed, checkpoint, trust_checkpoint)
    res = run_decode(cfg, model, s, budget_bytes=budget, progress=progress)
    return res.model_copy(update={"recipe": str(recipe) if isinstance(recipe, (str, Path)) else None,
                                  "checkpoint": None if checkpoint is None else str(checkpoint), "threads": threads})


def _check_decode_paths(cfg, mode, dev, *, cuda_graph: bool | None, compile: bool, split_batch: int) -> None:
    """Refuse (RecipeError) the decode paths this device or combination cannot run: CUDA graphs off CUDA, a
    split batch under compile, the Triton MLA kernel where it cannot run."""
    from scaletool.kernels.mla_decode import triton_supports
    from scaletool.kinds.attention import attention_kind
    from scaletool.model.layers import TORCH_DTYPES

    if cuda_graph and dev.type != "cuda":
        raise RecipeError("cuda_graph: CUDA graphs need a CUDA device")
    if compile and split_batch != 1:
        raise RecipeError(f"split_batch {split_batch}: the batch's parts run on separate CUDA streams, which the "
                          "compiled step does not take; drop compile or use split_batch 1")
    if mode.kernel == "triton" and attention_kind(cfg).decode_path(cfg, mode.mla) == "absorbed":
        why = triton_supports(dev, TORCH_DTYPES[cfg.dtype], cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if why:
            raise RecipeError(f"mla_kernel triton: the fused kernel cannot run here: {why}")


def _announce_build(progress, cfg, dev, checkpoint) -> None:
    """Tell ``progress`` that the model is being built, and that random CPU weights take a while."""
    from scaletool.analytic.params import param_counts
    from scaletool.decode.sizing import weight_bytes
    from scaletool.fmt import gib

    slow = dev.type == "cpu" and checkpoint is None and weight_bytes(cfg) > 2**29
    progress(0, None, f"decode: building the model on {dev.type} ({param_counts(cfg)['total']:,} "
                      f"parameters, {gib(weight_bytes(cfg))} at {cfg.dtype})"
                      + ("; drawing random weights on a CPU takes a while" if slow else ""))


def _launch_defaults(dev, pdl: bool | None, gemv: bool | None, compile: bool) -> tuple[bool, bool]:
    """``decode``'s PDL (None: where the GPU has it) and GEMV (None: with PDL under ``compile``, where
    Inductor's kernels around it let it load its weights early)."""
    if pdl is None:
        from scaletool.kernels.pdl import supported

        pdl = supported(dev)
    return bool(pdl), bool(pdl and compile) if gemv is None else bool(gemv)


def _decode_device(device: str | None):
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise RecipeError(f"device: decode runs on cuda or cpu, got {str(device)[:40]!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device cuda: no CUDA device is available here (use cpu)")
    return torch.device(device)


def _decode_model(r: Recipe, dev, seed: int, checkpoint, trust_checkpoint: bool):
    """The recipe's model on ``dev`` at its dtype, in eval mode: random weights from ``seed``, or a checkpoint's."""
    import torch

    from scaletool.model import build_model
    from scaletool.model.layers import TORCH_DTYPES

    model = build_model(r.model, dev, seed=seed, sdpa_backend=r.train.sdpa_backend)
    if checkpoint is not None:
        from scaletool.train.checkpoint import load_model_weights

        load_model_weights(checkpoint, model, trust_checkpoint=trust_checkpoint)
    model = model.to(TORCH_DTYPES[r.model.dtype]).eval()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model


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
          wandb: str | None = None, join_timeout_s: int | None = None):
    """Train ``recipe`` and return its :class:`~scaletool.results.train.TrainResult` (also ``<out>/summary.json``).

    Runs in this process (one rank, or a rank of torchrun or the DeepSpeed launcher), or, with
    ``nproc_per_node`` N outside a launcher, starts N local ranks under torchrun and returns rank 0's
    result. ``resume``: ``never`` (a run directory holding a run is refused), ``auto`` (continue from
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
    from scaletool.train.resume import Resume

    r = resolve(recipe, overrides)
    resume = Resume.parse(resume)
    peak_tflops = _positive_finite("peak_tflops", peak_tflops)
    join_timeout_s = None if join_timeout_s is None else _positive("join_timeout_s", join_timeout_s)
    options = _wandb_options(wandb)
    le = launcher_env()
    if not le["launched"]:  # the top of the run (alone, or the parent of local ranks): one run per directory
        from scaletool.sweep.lock import run_lock

        out = Path(out or default_out(recipe))
        with run_lock(out, what=f"scaletool train {recipe if isinstance(recipe, (str, Path)) else '(a recipe object)'}"):
            return _train_here(r, recipe, overrides, out, resume, peak_tflops, measure, nproc_per_node, callbacks,
                               quiet, options, wandb, join_timeout_s, le)
    return _train_here(r, recipe, overrides, out, resume, peak_tflops, measure, nproc_per_node, callbacks, quiet,
                       options, wandb, join_timeout_s, le)


def _train_here(r, recipe, overrides, out, resume, peak_tflops, measure, nproc_per_node, callbacks, quiet, options,
                wandb, join_timeout_s, le):
    """api.train once the run directory is this process's: local ranks, or this process's own rank."""
    from scaletool.engines import check_recipe
    from scaletool.engines.float8 import check_runtime
    from scaletool.measure.count import train_memory_check

    if not le["launched"]:  # before any rank builds a model: a run that cannot fit is one line, not an OOM kill
        train_memory_check(r, nproc_per_node or 1)
    check_runtime(r)  # train.float8 on a device without FP8, or without torchao: before anything is written
    if nproc_per_node is not None and not le["launched"]:
        if nproc_per_node > 1 or engine_kind(r.parallel.engine).distributed:
            if callbacks:
                raise RecipeError("callbacks: the ranks of a multi-process run are separate processes; pass "
                                  "callbacks to a run in this process (or to each rank's own train call)")
            return _train_local_ranks(recipe, overrides, r, nproc_per_node, Path(out or default_out(recipe)), resume,
                                      peak_tflops, measure, wandb, quiet)
    elif nproc_per_node is not None and nproc_per_node != le["local_world_size"]:
        raise RecipeError(f"nproc_per_node={nproc_per_node}: this process is one of {le['local_world_size']} local "
                          "ranks started by a launcher; leave it unset or make them agree")
    check_recipe(r, le["world_size"], le["local_world_size"] if le["launched"] else None)
    return _train_rank(r, recipe, out, resume, peak_tflops, measure, callbacks, quiet, options, join_timeout_s)


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


def _train_rank(r: Recipe, recipe: RecipeLike, out, resume, peak_tflops, measure, callbacks, quiet, wandb,
                join_timeout_s=None):
    """This process's rank of the run: join the process group, train, leave it."""
    import torch.distributed as dist

    from scaletool.engines import agree, init_distributed
    from scaletool.engines.dist import leave_distributed
    from scaletool.errors import describe
    from scaletool.profile import recipe_callbacks
    from scaletool.train.summary import failed_result
    from scaletool.train.trainer import Trainer, TrainFailed

    owned = not dist.is_initialized()
    env = init_distributed(r.parallel.engine, r.parallel.collective_timeout_s, join_timeout_s)
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
            trainer = None  # free the model (DDP's reducer owns the group) while the group is still registered
    finally:
        if owned:
            leave_distributed()


def _train_local_ranks(recipe: RecipeLike, overrides: Sequence[str], r: Recipe, nproc: int, out: Path, resume,
                       peak_tflops, measure: bool, wandb: str | None, quiet: bool):
    """Start ``nproc`` local ranks under torchrun (this process is their agent); rank 0's result."""
    import json
    import time

    import yaml

    from scaletool.engines import check_recipe
    from scaletool.errors import cannot_write
    from scaletool.fmt import write_atomic
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
    with cannot_write(out, "the run directory"):  # before any rank starts
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(recipe, Recipe):  # the ranks read the recipe from a file
            write_atomic(out / "recipe.yaml", yaml.safe_dump(recipe.model_dump(mode="json", exclude_unset=True)))
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
