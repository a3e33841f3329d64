"""Training engines: one module per engine, one small interface.

An :class:`Engine` owns the wrapped model and its optimizer and does one optimizer step over a
list of micro-batches (``train_step``), with gradient accumulation, clipping and mixed precision as
its backend does them; ``save``/``load`` write and read its native checkpoint format. The training
loop (:mod:`scaletool.train.loop`) sees only this interface.

- ``single`` (:mod:`.single`): one device, autocast mixed precision; also the base of DDP and FSDP.
- ``ddp`` (:mod:`.ddp`): ``DistributedDataParallel``, ``no_sync`` while accumulating.
- ``fsdp`` (:mod:`.fsdp`): FSDP2 ``fully_shard`` per block then the root.
- ``deepspeed`` (:mod:`.deepspeed`): ``deepspeed.initialize`` with ZeRO stage 0-3.

Model code stays single-device; what makes it distributed, checkpointed or compiled is applied
here, to the built model, as torchtitan's ``parallelize`` does.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletool.config import Recipe, RecipeError, TrainConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, sizes, its device and the process-group backend."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launched: bool  # started by torchrun or the DeepSpeed launcher (env:// rendezvous)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_env() -> dict:
    """Rank layout from the environment torchrun or the DeepSpeed launcher sets (1 process if none)."""
    e = os.environ
    world = int(e.get("WORLD_SIZE", 1))
    return {"launched": "RANK" in e and "MASTER_ADDR" in e, "rank": int(e.get("RANK", 0)), "world_size": world,
            "local_rank": int(e.get("LOCAL_RANK", 0)),
            "local_world_size": int(e.get("LOCAL_WORLD_SIZE", e.get("LOCAL_SIZE", world)))}


def init_distributed(engine: str, timeout_s: int | None = None) -> DistEnv:
    """Join the env:// process group when launched (nccl on CUDA, gloo on CPU).

    A single process running a distributed engine (ddp, fsdp, deepspeed) gets a one-rank group on
    an in-memory store, so the same code path runs with world size 1. ``timeout_s``
    (``parallel.collective_timeout_s``) bounds the group's setup and every collective: a rank whose
    peers died or hang fails with an error instead of waiting forever (None: torch's default).
    """
    le = launcher_env()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", le["local_rank"]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if le["launched"]:
            dist.init_process_group(backend, init_method="env://", device_id=device if cuda else None,
                                    timeout=timedelta(seconds=timeout_s) if timeout_s else None)
        elif engine != "single":
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(le["rank"], le["world_size"], le["local_rank"], le["local_world_size"], device, backend,
                   le["launched"])


def agree(value, env: DistEnv):
    """Rank 0's ``value`` on every rank (e.g. a timestamped run directory)."""
    if not dist.is_initialized() or env.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_recipe(recipe: Recipe, world_size: int, local_world_size: int | None) -> None:
    """Problems of a recipe that only show at launch; one RecipeError line each."""
    p = recipe.parallel
    given = p.model_fields_set
    problems = []
    if p.engine == "single" and world_size > 1:
        problems.append(f"parallel.engine: single runs one process, but {world_size} were started; "
                        "use ddp, fsdp or deepspeed")
    if local_world_size is not None and "nproc_per_node" in given and p.nproc_per_node != local_world_size:
        problems.append(f"parallel.nproc_per_node: the recipe says {p.nproc_per_node}, but {local_world_size} "
                        "processes per node were started; make them agree (or drop the key)")
    only = {"zero_stage": "deepspeed", "offload_optimizer": "deepspeed", "offload_params": "deepspeed",
            "deepspeed": "deepspeed", "cpu_offload": "fsdp"}
    for key, engine in only.items():
        if key in given and p.engine != engine and getattr(p, key) not in (False, {}):
            problems.append(f"parallel.{key}: only used by engine={engine}, but parallel.engine={p.engine}")
    if p.engine == "deepspeed":
        from scaletool.engines.deepspeed import deepspeed_config
        problems += deepspeed_config(recipe, world_size)[1]
    if problems:
        raise RecipeError(problems)


# ---------------------------------------------------------------------------------------------
# What every engine applies to the plain model


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


class Engine(ABC):
    """The loop's view of an engine. Subclasses set ``name`` and ``model`` (the callable module)."""

    name: str
    model: nn.Module

    @abstractmethod
    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``batches`` (the micro-batches of this rank, on its device).

        Returns this rank's mean micro-batch loss and the global gradient norm before clipping
        (None where not computed), both as device tensors: nothing here synchronises the host.
        """

    @abstractmethod
    def save(self, path: Path) -> None:
        """Write model and optimizer state to the directory ``path`` (collective)."""

    @abstractmethod
    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (collective)."""


def make_engine(recipe: Recipe, env: DistEnv) -> Engine:
    """Build the recipe's model on this rank's device (same seed on every rank) and wrap it."""
    from scaletool.model import build_model
    t = recipe.train
    model = build_model(recipe.model, env.device, seed=t.seed, sdpa_backend=t.sdpa_backend)
    engine = recipe.parallel.engine
    if engine == "single":
        from scaletool.engines.single import SingleEngine as cls
    elif engine == "ddp":
        from scaletool.engines.ddp import DDPEngine as cls
    elif engine == "fsdp":
        from scaletool.engines.fsdp import FSDPEngine as cls
    else:
        from scaletool.engines.deepspeed import DeepSpeedEngine as cls
    return cls(model, recipe, env)
