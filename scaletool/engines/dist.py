"""Where a process sits in the job: rank, sizes, device, and the process group it joins."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletool.allocator import allocator_defaults
from scaletool.kinds.engines import engine_kind


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


def init_distributed(engine: str, timeout_s: int | None = None, join_timeout_s: int | None = None) -> DistEnv:
    """Join the env:// process group when launched (nccl on CUDA, gloo on CPU).

    A single process running a distributed engine (ddp, fsdp, deepspeed) gets a one-rank group on
    an in-memory store, so the same code path runs with world size 1. ``timeout_s``
    (``parallel.collective_timeout_s``) bounds the group's setup and every collective: a rank whose
    peers died or hang fails with an error instead of waiting forever (None: torch's default).
    ``join_timeout_s`` bounds only the wait for every rank to reach the store at MASTER_ADDR:MASTER_PORT
    (:func:`join_store`), for launchers without a rendezvous of their own (the DeepSpeed launcher).
    """
    allocator_defaults()  # before this process's first CUDA allocation (scaletool.allocator)
    le = launcher_env()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", le["local_rank"]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        if le["launched"] and join_timeout_s:
            store = join_store(le["rank"], le["world_size"], join_timeout_s, timeout or default_timeout(backend))
            dist.init_process_group(backend, store=store, rank=le["rank"], world_size=le["world_size"],
                                    device_id=device if cuda else None, timeout=timeout)
        elif le["launched"]:
            dist.init_process_group(backend, init_method="env://", device_id=device if cuda else None,
                                    timeout=timeout)
        elif engine_kind(engine).distributed:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(le["rank"], le["world_size"], le["local_rank"], le["local_world_size"], device, backend,
                   le["launched"])


def join_store(rank: int, world_size: int, join_timeout_s: int, timeout: timedelta) -> dist.TCPStore:
    """The group's TCPStore at MASTER_ADDR:MASTER_PORT, as env:// builds it, once every rank has joined.

    Rank 0 hosts it and waits for the other ranks to connect; they retry until it listens. Either side
    gives up after ``join_timeout_s`` with a :class:`~scaletool.errors.JoinError`, where env:// would
    wait the group's whole timeout (30 minutes on gloo) for a node that never started; a port that rank 0
    cannot listen on is one too. The store then takes the group's own timeout for everything after the
    join, as env:// gives it.
    """
    from scaletool.errors import JoinError

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=join_timeout_s), wait_for_workers=True)
    except (dist.DistError, RuntimeError) as e:
        text = str(e)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        cause = lines[0].rstrip(".") if lines else type(e).__name__
        where = f"{addr}:{port}"
        if "EADDRINUSE" in text:
            raise JoinError(f"rank 0 cannot host the group's store at {where}: the port is in use on this host "
                            "(another job?); pick another port in --rdzv-endpoint") from e
        if "timed out" not in text.lower():
            raise JoinError(f"cannot join the group's store at {where}: {cause}") from e
        raise JoinError(f"the {world_size} ranks did not all join at {where} within {join_timeout_s} s (--join-timeout; "
                        f"`scaletool launch deepspeed --rdzv-timeout`): {cause}; start the launch on every node with "
                        "the same --rdzv-endpoint and check that its port is reachable from each") from e
    store.set_timeout(timeout)
    return store


def default_timeout(backend: str) -> timedelta:
    """torch's timeout for a group of ``backend`` made without one (NCCL's is shorter)."""
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    return default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout else default_pg_timeout


def leave_distributed() -> None:
    """Leave the process group this process joined, after gloo's worker threads have let go of their work.

    A gloo worker destroys a finished work item (say, the last ``all_gather_object``) after the caller
    has already returned, and destroying its Python-created tensors takes the GIL. If the main thread
    meanwhile frees the last owner of the group (DDP's reducer at the end of a run), the group's
    destructor joins that worker while holding the GIL: both wait forever (a two-rank CPU run hung at
    exit about half the time). Sleeping releases the GIL, so the worker finishes first.
    """
    import time

    if dist.is_initialized():
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            time.sleep(0.05)
        dist.destroy_process_group()


def end_worker_process() -> None:
    """Exit status 0 now, skipping the interpreter's native teardown: for a launched rank whose output is
    all written and whose process group is gone.

    DeepSpeed over gloo intermittently aborts in that teardown ("terminate called without an active
    exception": a joinable C++ thread destroyed at exit; about 1 in 4 CPU ZeRO-3 runs, and once a
    ZeRO-2 job of the memory-phase driver in CI), which the launcher reports as a failed rank.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def agree(value, env: DistEnv):
    """Rank 0's ``value`` on every rank (e.g. a timestamped run directory)."""
    if not dist.is_initialized() or env.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def device_mesh(env: DistEnv, tensor_parallel: int = 1, replicate: int = 1) -> DeviceMesh:
    """The ranks as a ``("dp", "tp")`` mesh (``("dp",)`` without tensor parallelism), row-major: a
    tensor-parallel group is ``tensor_parallel`` consecutive ranks (one node's, as torchtitan lays it out).
    HSDP (``replicate`` > 1): a ``("dp_replicate", "dp_shard")`` mesh, torchtitan's names, a shard group being
    ``world_size / replicate`` consecutive ranks (one node's), flattened to ``"dp"`` for what reduces over every
    data-parallel rank; with tensor parallelism ``("dp_replicate", "dp_shard", "tp")``, the TP groups innermost."""
    if replicate > 1 and tensor_parallel > 1:  # HSDP × TP: a (replicate, shard, tp) mesh, TP groups innermost
        mesh = init_device_mesh(env.device.type,
                                (replicate, env.world_size // (replicate * tensor_parallel), tensor_parallel),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "tp"]._flatten()  # the gradient norm's one all-reduce over the dimensions it is partial on
        return mesh
    if replicate > 1:
        mesh = init_device_mesh(env.device.type, (replicate, env.world_size // replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        mesh._flatten("dp")
        return mesh
    if tensor_parallel == 1:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("dp",))
    mesh = init_device_mesh(env.device.type, (env.world_size // tensor_parallel, tensor_parallel),
                            mesh_dim_names=("dp", "tp"))
    # the gradient norm reduces over both dimensions: with the flattened group DTensor does it in one
    # all-reduce instead of one per dimension (torchtitan flattens its meshes the same way)
    mesh._flatten()
    return mesh


def data_parallel(env: DistEnv, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) in :func:`device_mesh`'s layout, pipeline ranks outermost
    (engines.pipeline's ``("pp", "dp")`` mesh): the ranks of one tensor-parallel group, and the stages of one
    pipeline, read the same batch."""
    size = env.world_size // (tensor_parallel * pipeline_parallel)
    return (env.rank // tensor_parallel) % size, size
