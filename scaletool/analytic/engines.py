"""Each shipped engine's analytic parts, provided to its kind: the memory closed form
(:mod:`scaletool.analytic.engine_memory`), the data-parallel collectives (:mod:`scaletool.analytic.collectives`)
and the step-time terms (:mod:`scaletool.analytic.engine_step`).

The analytic modules that use them (memory, comm, step) read them through :func:`kind_with_forms`, so
importing any of those provides every shipped engine's forms first. A new engine's forms are provided here
(or by the module that registers its kind, from anywhere above :mod:`scaletool.kinds`): see
docs/extending.md.
"""
from __future__ import annotations

from scaletool.analytic.collectives import ddp_communication, fsdp_communication, no_communication, zero_communication
from scaletool.analytic.engine_memory import ddp_memory, fsdp_memory, single_memory, zero_memory
from scaletool.analytic.engine_step import ddp_step, fsdp_step, single_step, zero_step
from scaletool.kinds.engines import DDP, DEEPSPEED, FSDP, SINGLE, EngineKind, engine_kind

SINGLE.provide(memory=single_memory, communication=no_communication, step=single_step)
DDP.provide(memory=ddp_memory, communication=ddp_communication, step=ddp_step)
FSDP.provide(memory=fsdp_memory, communication=fsdp_communication, step=fsdp_step)
DEEPSPEED.provide(memory=zero_memory, communication=zero_communication, step=zero_step)


def kind_with_forms(engine: str) -> EngineKind:
    """The kind of ``engine`` once this module has provided the shipped engines' forms (KeyError: unknown)."""
    return engine_kind(engine)
