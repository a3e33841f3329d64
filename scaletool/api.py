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
