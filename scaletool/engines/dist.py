"""Where a process sits in the job: rank, sizes, device, and the process group it joins."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
