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


def compile_kwargs(t: TrainConfig) -> dict:
    """``torch.compile``'s keyword arguments for ``train.compile_mode`` (none for the default mode)."""
    return {} if t.compile_mode == "default" else {"mode": t.compile_mode}


def compile_blocks(model: nn.Module, t: TrainConfig | None = None) -> None:
    """``torch.compile`` each block (torchtitan's choice for sharded engines: the FSDP/DDP hooks stay
    between compiled regions, so communication still overlaps the backward of earlier blocks), in
    ``train.compile_mode``: reduce-overhead puts each compiled block in CUDA graphs."""
    kwargs = compile_kwargs(t) if t is not None else {}
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, **kwargs)
