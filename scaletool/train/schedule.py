"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio × lr``."""
from __future__ import annotations

import math

from scaletool.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``t.steps``.

    Warm-up rises linearly to ``lr`` over ``warmup_steps`` (step 0 already gets lr/warmup, never 0);
    the cosine then runs over the remaining steps and ends at the floor on the last step.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    floor = t.lr * t.min_lr_ratio
    span = max(t.steps - t.warmup_steps - 1, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
