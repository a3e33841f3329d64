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
             world_size: int | None = None):
    """The analytic model of ``recipe``: parameters, FLOPs, KV cache and training memory in two phases
    (no model built). Returns an :class:`~scaletool.results.estimate.EstimateResult`."""
    from scaletool import analytic
    from scaletool.results.estimate import EstimateResult

    return EstimateResult.model_validate(analytic.estimate(resolve(recipe, overrides), tokens=tokens,
                                                           world_size=world_size))


def count(recipe: RecipeLike, *, overrides: Sequence[str] = (), device: str = "meta", batch: int = 1,
          fvcore: bool = True):
    """Build ``recipe``'s model on ``device`` (meta: no memory) and measure its parameters and FLOPs
    against the closed forms. On cpu or cuda the memory the count needs is estimated first and a count
    that would not fit is refused (RecipeError) before anything is allocated; so is a device this
    machine does not have. Returns a :class:`~scaletool.results.count.CountResult`."""
    from scaletool.measure.count import count as measure
    from scaletool.results.count import CountResult

    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise RecipeError(f"batch: expected a positive number of sequences, got {str(batch)[:40]!r}")
    return CountResult.model_validate(measure(resolve(recipe, overrides), device=device, batch=batch, fvcore=fvcore))
