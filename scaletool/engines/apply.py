"""What every engine applies to the plain model before wrapping it (torchtitan's ``parallelize``
steps that are not sharding): activation checkpointing and per-block ``torch.compile``."""
from __future__ import annotations

import torch
import torch.nn as nn

from scaletool.config import TrainConfig


def apply_activation_checkpointing(model: nn.Module, t: TrainConfig) -> None:
    """Wrap blocks with non-reentrant ``checkpoint_wrapper``: every block (full) or every
    ``selective_every``-th block (selective: L // selective_every blocks, as the analytic model counts)."""
    if t.activation_checkpointing == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.layers):
        if t.activation_checkpointing == "full" or (i + 1) % t.selective_every == 0:
            model.layers[i] = checkpoint_wrapper(block)


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each block (torchtitan's choice for sharded engines: the FSDP/DDP hooks stay
    between compiled regions, so communication still overlaps the backward of earlier blocks)."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block)
