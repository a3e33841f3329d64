"""``recipe show``: a recipe with every default and derived field resolved, its inactive keys and its key."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from scaletool.results.base import Result, register


@register
class RecipeResult(Result):
    """The resolved recipe (valid recipe input as it is), the keys given for another attention or FFN
    type (inactive: they hold their defaults in ``recipe``), and the digest that keys its results."""

    kind: Literal["recipe"] = "recipe"
    source: str = Field(description="the recipe file")
    recipe: dict[str, Any]
    inactive: dict[str, Any] = Field(default_factory=dict, description="dotted key -> the value given")
    digest: str = Field(description="Recipe.digest(): what a sweep keys this recipe's results by")
