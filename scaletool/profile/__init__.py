"""Profiling: ``torch.profiler`` traces and operator breakdowns (:mod:`.trace`, :mod:`.breakdown`) and
training-dynamics monitors (:mod:`.monitors`), all plugged into the trainer as callbacks.

The trainer does not know this package: whoever starts a run (:func:`scaletool.api.train`) passes
:func:`recipe_callbacks` in, the one place a recipe's callbacks are assembled, so a ``profile:``
section and a MoE model's load metrics and router-bias updates work in every ``scaletool train`` run.
"""
from __future__ import annotations

from scaletool.config import Recipe
from scaletool.train.callbacks import Callback


def recipe_callbacks(recipe: Recipe) -> list[Callback]:
    """The callbacks a recipe asks for: a MoE model's (load metrics, router-bias updates), then its
    ``profile`` section's (none by default). The profiler goes before the monitors: its ``prof.step()``
    closes the step before a monitor runs."""
    from scaletool.profile.monitors import DynamicsMonitor
    from scaletool.profile.trace import ProfilerCallback
    from scaletool.train.moe import moe_callbacks

    p = recipe.profile
    return [*moe_callbacks(recipe), *([ProfilerCallback(p)] if p.enabled else []),
            *([DynamicsMonitor(p.monitors)] if p.monitors.enabled else [])]
