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

        # what the user gave (inactive keys included), so derived fields are derived again
        raw = apply_overrides(recipe.given(), [parse_override(o) for o in overrides])
        return recipe_from_dict(raw, "recipe")
    if not isinstance(recipe, (str, Path)):
        raise RecipeError(f"recipe: expected a path or a Recipe, got {type(recipe).__name__}")
    return load_recipe(recipe, list(overrides))


def estimate(recipe: RecipeLike, *, overrides: Sequence[str] = (), tokens: int | None = None,
             world_size: int | None = None) -> dict:
    """The analytic model of ``recipe``: parameters, FLOPs, KV cache and training memory (no model built)."""
    from scaletool import analytic

    return analytic.estimate(resolve(recipe, overrides), tokens=tokens, world_size=world_size)


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


def load_sweep(sweep_file: str | Path, overrides: Sequence[str] = ()):
    """A validated :class:`~scaletool.sweep.spec.Sweep` from its file, ``key=value`` overrides applied to every point."""
    from scaletool.config import parse_override
    from scaletool.sweep import spec

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


def decode(recipe: RecipeLike, *, overrides: Sequence[str] = (), contexts: Sequence[int] | None = None,
           batch: int | str | Sequence[int | str] = 1, new_tokens: int = 32, device: str | None = None,
           dtype: str | None = None, mla_mode: str = "absorbed", mla_kernel: str = "auto",
           cuda_graph: bool | None = None, memory_budget_gib: float | None = None, checkpoint: str | Path | None = None,
           trust_checkpoint: bool = False, seed: int = 0, prefill_chunk: int = 4096, warmup_steps: int = 3,
           prefill_repeats: int = 3, progress=None):
    """Prefill and decode ``recipe``'s model at each (context, batch); a :class:`~scaletool.results.decode.DecodeResult`.

    ``batch``: an int, 'max' (the largest batch whose weights + KV cache fit the memory budget, by
    the analytic fit) or a sequence of them (``[1, "max"]``). ``device``: 'cuda' or 'cpu' (default:
    cuda when available). ``cuda_graph``: replay each decode step from a CUDA graph (default: on for
    CUDA). ``memory_budget_gib``: for 'max' and the fit table (default: the GPU's memory; none on
    CPU). ``checkpoint``: a ``scaletool train`` checkpoint directory (default: random weights from
    ``seed``). ``progress(done, total, description)`` hears of each point. A run whose weights and
    largest cache exceed the memory available is refused before anything is allocated.
    """
    import torch

    from scaletool.decode.bench import DecodeSettings, plan_points, run_decode
    from scaletool.decode.generate import require_lm
    from scaletool.decode.sizing import cache_bytes_per_token, check_memory, memory_fit
    from scaletool.kernels.mla_decode import triton_supports
    from scaletool.model.attention import MLA_MODES, DecodeMode
    from scaletool.model.layers import TORCH_DTYPES

    r = resolve(recipe, [*overrides, *([f"model.dtype={dtype}"] if dtype else [])])
    cfg = r.model
    require_lm(cfg)
    if mla_mode not in MLA_MODES:
        raise RecipeError(f"mla_mode: expected one of {', '.join(MLA_MODES)}, got {str(mla_mode)[:40]!r}")
    if mla_mode == "naive" and cfg.attention != "mla":
        raise RecipeError(f"mla_mode naive is for attention=mla recipes; this one is {cfg.attention}")
    try:
        mode = DecodeMode(mla_mode, mla_kernel)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    dev = _decode_device(device)
    if cuda_graph and dev.type != "cuda":
        raise RecipeError("cuda_graph: CUDA graphs need a CUDA device")
    if mla_kernel == "triton" and cfg.attention == "mla" and mla_mode == "absorbed":
        why = triton_supports(dev, TORCH_DTYPES[cfg.dtype], cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if why:
            raise RecipeError(f"mla_kernel triton: the fused kernel cannot run here: {why}")
    contexts = tuple(_positive("context", n) for n in (contexts or (cfg.max_seq_len,)))
    s = DecodeSettings(batches=_batches(batch), contexts=contexts, new_tokens=_positive("new_tokens", new_tokens),
                       mode=mode, cuda_graph=dev.type == "cuda" if cuda_graph is None else cuda_graph,
                       prefill_chunk=_positive("prefill_chunk", prefill_chunk),
                       warmup_steps=_positive("warmup_steps", warmup_steps),
                       prefill_repeats=_positive("prefill_repeats", prefill_repeats), seed=seed)
    budget = int(memory_budget_gib * 2**30) if memory_budget_gib else (
        torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None)
    fit = None if budget is None else memory_fit(cfg, budget, s.contexts, s.extra_positions)
    largest = max(b * (n + s.extra_positions) for n, b in plan_points(cfg, s, fit))
    check_memory(cfg, largest * cache_bytes_per_token(cfg, mla_mode), dev)
    threads = None
    if dev.type == "cpu":
        from scaletool.threads import pin_threads

        threads = pin_threads()
    model = _decode_model(r, dev, seed, checkpoint, trust_checkpoint)
    res = run_decode(cfg, model, s, budget_bytes=budget, progress=progress)
    return res.model_copy(update={"recipe": str(recipe) if isinstance(recipe, (str, Path)) else None,
                                  "checkpoint": None if checkpoint is None else str(checkpoint), "threads": threads})


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
    import inspect

    import torch

    from scaletool.model import build_model
    from scaletool.model.layers import TORCH_DTYPES

    model = build_model(r.model, dev, seed=seed, sdpa_backend=r.train.sdpa_backend)
    if checkpoint is not None:
        from scaletool.train.checkpoint import load_model_weights

        # trust_checkpoint arrives with the train branch's safe loading; pass it once the loader has it
        takes_trust = "trust_checkpoint" in inspect.signature(load_model_weights).parameters
        load_model_weights(checkpoint, model, **({"trust_checkpoint": trust_checkpoint} if takes_trust else {}))
    model = model.to(TORCH_DTYPES[r.model.dtype]).eval()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model
