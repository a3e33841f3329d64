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
