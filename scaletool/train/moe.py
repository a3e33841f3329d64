"""Mixture-of-experts hooks for the trainer (a callback, see :mod:`scaletool.train.callbacks`).

- Expert load metrics (:func:`scaletool.model.moe.expert_load_metrics`), summed over data-parallel
  ranks, every ``train.log_every`` steps and after the last: ``moe/imbalance_ratio_mean``,
  ``moe/imbalance_ratio_max``, ``moe/dropped_fraction`` and the same per layer. They describe the
  last micro-batch of the step (each MoE module keeps the statistics of its last forward, which an
  activation-checkpointing recomputation rewrites with the same values). The summary gets the last
  figures in ``metrics`` and the tokens per expert of every MoE layer under ``moe``.
- The summary's ``moe`` also names the dispatch (``dropless`` | ``capacity``) and what ran the
  experts' GEMMs (``expert_gemm``: ``grouped_mm``, ``loop`` or ``bmm``) and, dropless, the permutation
  (``permute``: ``gather`` or ``indexed``, see :class:`scaletool.model.moe.MoE`).
- The aux-loss-free bias update of DeepSeek-V3 (``model.bias_update_speed`` > 0) after every
  optimizer step, from the same all-reduced load, so every rank moves its biases identically.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from scaletool.config import Recipe
from scaletool.engines.expert_parallel import ExpertParallelExperts
from scaletool.model.layers import TORCH_DTYPES
from scaletool.model.moe import expert_load_metrics, moe_layers
from scaletool.results.train import TrainResult
from scaletool.train.callbacks import Callback, StepState, TrainInfo


def _all_reduce_sum(t: torch.Tensor, group=None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


class MoECallback(Callback):
    def __init__(self, recipe: Recipe):
        self.steps, self.log_every = recipe.train.steps, recipe.train.log_every
        self.speed = recipe.model.bias_update_speed
        self.dispatch, self.dtype = recipe.model.moe_dispatch, TORCH_DTYPES[recipe.model.dtype]
        self.layers = []
        self.last: dict[str, float] = {}
        self.tokens_per_expert: dict[str, list[float]] = {}

    def on_train_start(self, info: TrainInfo) -> None:
        self.model = info.engine.model
        self.layers = moe_layers(self.model)
        # pipeline stages (engines.pipeline): each rank holds some MoE layers; sum each over its data-parallel
        # ranks only (rank 0 reports the layers of the first stage)
        mesh = getattr(info.engine, "mesh", None)
        self.group = mesh["dp"].get_group() if getattr(info.engine, "pp_group", None) is not None else None
        experts = self.layers[0].experts
        self.experts_per_rank = self.layers[0].n_experts // (
            experts.world if isinstance(experts, ExpertParallelExperts) else 1)

    def on_step_end(self, step: int, state: StepState) -> dict[str, float] | None:
        if self.speed:
            load = torch.stack([m.tokens_per_expert.float() for m in self.layers])  # (L, E)
            _all_reduce_sum(load, self.group)
            for m, row in zip(self.layers, load):
                m.update_bias(row, self.speed)
        if (step + 1) % self.log_every and step + 1 != self.steps:
            return None
        loads: list[torch.Tensor] = []

        def reduce(stacked: torch.Tensor) -> None:
            _all_reduce_sum(stacked, self.group)
            loads.append(stacked[:, :-2])

        self.last = expert_load_metrics(self.model, reduce=reduce)
        self.tokens_per_expert = {f"layer{m.layer_id}": row for m, row in zip(self.layers, loads[0].tolist())}
        return self.last

    def on_train_end(self, result: TrainResult) -> None:
        result.metrics.update({k: v for k, v in self.last.items() if k.count("/") == 1})
        result.moe = {"dispatch": self.dispatch, "expert_gemm": self.layers[0].expert_gemm(self.dtype),
                      "permute": self.layers[0].permute if self.dispatch == "dropless" else None,
                      "tokens_per_expert_last_step": self.tokens_per_expert,
                      "experts_per_rank": self.experts_per_rank,
                      "bias_update_speed": self.speed, "metrics_last_step": self.last}


def moe_callbacks(recipe: Recipe) -> list[Callback]:
    """The MoE callback for ffn=moe recipes, none otherwise."""
    return [MoECallback(recipe)] if recipe.model.ffn == "moe" else []
