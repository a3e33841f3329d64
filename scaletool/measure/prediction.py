"""The step-time model's calibration for a device, and its prediction for a recipe there.

A shipped or user calibration of the card is used when one exists; otherwise the datasheet-derived
default (scaletool.analytic.step.default_calibration), which on the CPU is a placeholder whose error
is not meaningful: a CPU run records its prediction only to exercise the whole path.
"""
from __future__ import annotations

from scaletool.analytic.step import default_calibration, load_calibration, predict_step
from scaletool.config import Recipe
from scaletool.errors import RecipeError


def calibration_for(hardware: str | None, device_type: str = "cuda"):
    """The calibration of ``hardware`` (a profile name), or the default for the device kind."""
    name = "CPU" if device_type == "cpu" or not hardware else hardware
    try:
        return load_calibration(name)
    except (FileNotFoundError, KeyError, LookupError, RecipeError):
        return default_calibration(name)


def predict(recipe: Recipe, calibration, world_size: int, gpus_per_node: int | None = None) -> dict:
    """The step-time model's prediction for the recipe as configured (its compile setting included)."""
    return predict_step(recipe, calibration, world_size=world_size, gpus_per_node=gpus_per_node or world_size,
                        compiled=recipe.train.compile)
