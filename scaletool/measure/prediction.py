"""The step-time model's calibration for a device, and its prediction for a recipe there.

A shipped calibration of the card (``profiles/calibrations/``) is used when one exists, else the
datasheet default derived from the card's hardware profile. The CPU has neither: its calibration is
a placeholder (:func:`cpu_calibration`) so that a CPU run records a prediction and exercises the
whole path; its error there is not meaningful and says nothing about the model.
"""
from __future__ import annotations

from scaletool.analytic.calibration import Calibration, calibration_for, default_calibration, load_calibration
from scaletool.analytic.step import predict_step
from scaletool.config import Recipe
from scaletool.errors import RecipeError

#: the CPU placeholder's rates: a few-core CPU's order of magnitude, not a measurement
CPU_PLACEHOLDER = {"gemm_tflops": 0.1, "half_dim": 64, "attention_tflops": 0.02, "memory_gb_s": 10.0, "gloo_gb_s": 1.0}
CPU_NOTE = "CPU placeholder (not measured): the prediction's error on a CPU is not meaningful"


def cpu_calibration() -> Calibration:
    """A shipped or user calibration named ``cpu`` when there is one, else the placeholder."""
    try:
        return load_calibration("cpu")
    except RecipeError:
        pass
    c = CPU_PLACEHOLDER
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return Calibration(
        name="CPU (placeholder)", source=CPU_NOTE, hardware="CPU", peak_tflops=c["gemm_tflops"],
        gemm_tflops={"max_tflops": c["gemm_tflops"], "half_dim": c["half_dim"]},
        attention_tflops={"default": c["attention_tflops"]}, hbm_gb_s=c["memory_gb_s"],
        collectives={"intra_node_gb_s": {op: {2: c["gloo_gb_s"]} for op in ops}, "inter_node_gb_s": c["gloo_gb_s"],
                     "source": "placeholder: gloo over shared memory"},
        overheads={"step_s": 0.01, "micro_batch_s": 0.005})


def calibration_for_device(device_type: str, profile=None) -> Calibration:
    """The calibration for a device: the CPU placeholder, the card's shipped calibration, or the
    datasheet default of its hardware ``profile`` (a RecipeError when there is no profile to derive from)."""
    if device_type == "cpu":
        return cpu_calibration()
    if profile is None:
        raise RecipeError("no hardware profile matches this GPU, so there is no calibration to predict with "
                          "(`scaletool hardware` says how to add a profile)")
    return calibration_for(profile.name) or default_calibration(profile)


def predict(recipe: Recipe, calibration: Calibration, world_size: int, gpus_per_node: int | None = None) -> dict:
    """The step-time model's prediction for the recipe as configured (its compile setting included)."""
    return predict_step(recipe, calibration, world_size=world_size, gpus_per_node=gpus_per_node,
                        compiled=recipe.train.compile)
