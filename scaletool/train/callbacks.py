"""What a training callback sees and may do: the typed protocol, a no-op base, and the loop's view.

A callback (a profiler, a training-dynamics monitor, MoE load balancing) plugs into
:class:`~scaletool.train.trainer.Trainer` without touching it. The trainer calls every method of
every callback, in order, so a callback subclasses :class:`Callback` and overrides what it needs:

- ``on_train_start(info)``: once, after the engine is built (and restored, when resuming).
- ``on_step_start(step)``: before the step's data are built.
- ``on_step_end(step, state)``: after the optimizer step. ``state`` holds device tensors (``loss``,
  ``grad_norm``): reading them synchronises, so do it sparingly. A returned dict of namespaced
  scalars (``{"monitor/attention_entropy_nats": 2.1}``) is written with the step's metrics
  (metrics.jsonl, TensorBoard, W&B).
- ``on_train_end(result)``: once, on every rank, after a run that ended normally (completed or
  diverged), before ``summary.json`` is written; what it sets on ``result`` (``result.profile = {...}``,
  ``result.metrics[...]``) is saved with it. A run that fails with an exception skips it: the peers
  may be gone, and these hooks may use collectives.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from scaletool.config import Recipe
    from scaletool.engines import DistEnv, Engine
    from scaletool.results.train import TrainResult
    from scaletool.train.metrics import MetricsWriter


@dataclass
class TrainInfo:
    """The run as callbacks see it at ``on_train_start``."""

    recipe: Recipe
    out_dir: Path
    env: DistEnv
    engine: Engine  # ``engine.model`` is the module being trained
    writer: MetricsWriter  # log() for messages; scalars go back through on_step_end's return value
    unmeasured: Callable[[], AbstractContextManager]  # work between steps left out of every timing


@dataclass
class StepState:
    """One finished optimizer step, as ``on_step_end`` sees it."""

    step: int
    loss: torch.Tensor  # this rank's mean micro-batch loss, on the device (not yet fetched)
    grad_norm: torch.Tensor | None
    lr: float
    tokens: int  # global tokens in this step
    engine: Engine


class TrainCallback(Protocol):
    """The hooks the trainer calls on every callback."""

    def on_train_start(self, info: TrainInfo) -> None: ...

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int, state: StepState) -> dict[str, float] | None: ...

    def on_train_end(self, result: TrainResult) -> None: ...


class Callback:
    """A :class:`TrainCallback` whose hooks do nothing: subclass it and override what you need."""

    def on_train_start(self, info: TrainInfo) -> None:
        pass

    def on_step_start(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, state: StepState) -> dict[str, float] | None:
        return None

    def on_train_end(self, result: TrainResult) -> None:
        pass
