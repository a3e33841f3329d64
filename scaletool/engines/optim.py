"""The optimizer every torch-native engine uses: AdamW with decay on matrices only."""
from __future__ import annotations

import torch
import torch.nn as nn

from scaletool.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices and embeddings (dim >= 2), not norms and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_adamw(model: nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused on CUDA unless ``train.fused_optimizer`` says otherwise (foreach elsewhere)."""
    fused = t.fused_optimizer if t.fused_optimizer is not None else device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                             fused=fused or None, foreach=None if fused else True)
