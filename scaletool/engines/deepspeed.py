"""DeepSpeed: ``deepspeed.initialize`` with ZeRO stage 0-3, configured from the recipe.

The DeepSpeed config is built from the recipe (micro-batch, accumulation, clipping, precision,
ZeRO stage, offload) on top of defaults of our own; ``parallel.deepspeed`` is then merged in
unchanged. A passthrough key that contradicts a recipe field is reported, one line per key,
instead of silently winning. The learning rate follows :mod:`scaletool.train.schedule` for every
engine, so a DeepSpeed ``scheduler`` section is a conflict too. These rules live in
:mod:`scaletool.config` (``deepspeed_settings``, ``deepspeed_problems``) so that validating a recipe
runs them; only ``train_batch_size`` waits for the world size.

The optimizer is torch's AdamW (fused on CUDA), handed to DeepSpeed as a client optimizer; with
``offload_optimizer`` DeepSpeed's own CPU Adam (declared in the config) runs the step on the CPU.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from scaletool.analytic import ZERO_REDUCE_BUCKET
from scaletool.config import Recipe, deepspeed_problems, deepspeed_settings, flatten_dotted
from scaletool.engines.apply import apply_activation_checkpointing
from scaletool.engines.base import Engine
from scaletool.engines.dist import DistEnv
from scaletool.engines.optim import make_adamw, param_groups
from scaletool.model.layers import TORCH_DTYPES as DTYPES

# Ours, not derived from a recipe field: the passthrough may override them freely.
DEFAULTS = {
    "steps_per_print": 2**31 - 1,  # the loop logs; DeepSpeed's own step log would interleave
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer under ZeRO
    "zero_optimization": {"overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": ZERO_REDUCE_BUCKET, "allgather_bucket_size": 5e8},
}


def _set(d: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


def deepspeed_config(recipe: Recipe, world_size: int) -> tuple[dict, list[str]]:
    """(config, problems): the DeepSpeed config for ``recipe`` and one line per passthrough conflict
    (:func:`scaletool.config.deepspeed_problems`; a validated recipe can only still conflict on
    ``train_batch_size``, which needs the world size)."""
    derived = deepspeed_settings(recipe, world_size)
    config = copy.deepcopy(DEFAULTS)
    for key, (value, _) in derived.items():
        _set(config, key, value)
    for key, value in flatten_dotted(recipe.parallel.deepspeed).items():
        if key not in derived or derived[key][0] == value:
            _set(config, key, value)
    return config, deepspeed_problems(recipe, world_size)


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, recipe: Recipe, env: DistEnv):
        os.environ.setdefault("DS_ACCELERATOR", env.device.type)
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))  # DeepSpeed insists, even for one process
        import deepspeed

        self.env = env
        t = recipe.train
        config, _ = deepspeed_config(recipe, env.world_size)  # problems were reported at launch
        apply_activation_checkpointing(model, t)
        deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
        if recipe.parallel.offload_optimizer:
            kw = {"model_parameters": param_groups(model, t.weight_decay)}
        else:
            kw = {"optimizer": make_adamw(model, t, env.device)}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, config=config, **kw)
        if t.compile:
            self.engine.compile()
        self.model = self.engine
        self.dtype = DTYPES[recipe.model.dtype]

    def train_step(self, batches, lr):
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        total = None
        for inputs, targets in batches:
            if inputs.is_floating_point():  # regression features meet 16-bit weights: no autocast here
                inputs = inputs.to(self.dtype)
            loss = self.engine(inputs, targets)
            self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            self.engine.step()  # applies the update only at the accumulation boundary
            total = loss.detach().float() if total is None else total + loss.detach().float()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and not torch.is_tensor(norm):
            norm = torch.tensor(float(norm), device=total.device)
        return total / len(batches), norm

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path.parent), tag=path.name)

    def load(self, path: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
