"""Profiling: ``torch.profiler`` traces and operator breakdowns (:mod:`.trace`, :mod:`.breakdown`) and
training-dynamics monitors (:mod:`.monitors`), all plugged into the trainer as callbacks.

The trainer does not know this package: whoever starts a run (:func:`scaletool.api.train`) passes
:func:`recipe_callbacks` in, so a ``profile:`` section works in every ``scaletool train`` run.
"""
from __future__ import annotations

from scaletool.config import Recipe
from scaletool.train.callbacks import Callback


def recipe_callbacks(recipe: Recipe) -> list[Callback]:
    """The callbacks a recipe's ``profile`` section asks for (none by default). The profiler goes first:
    its ``prof.step()`` closes the step before a monitor runs."""
    from scaletool.profile.monitors import DynamicsMonitor
    from scaletool.profile.trace import ProfilerCallback

    p = recipe.profile
    return ([ProfilerCallback(p)] if p.enabled else []) + ([DynamicsMonitor(p.monitors)] if p.monitors.enabled else [])
