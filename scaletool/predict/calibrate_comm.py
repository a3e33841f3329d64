"""Bus bandwidth of all-gather, reduce-scatter, all-reduce and all-to-all (NCCL on GPUs, gloo on the CPU), the
figures the step-time model divides wire bytes by (NCCL's bus bandwidth convention: wire bytes per rank over time,
nccl-tests PERFORMANCE.md), each at several message sizes with its median, p10/p90 and n (warm-up excluded).

Two ways in:

- :func:`measure_collectives`: ``world`` local processes started with ``torch.multiprocessing``, meeting through
  a file store in a private temporary directory; group sizes 2..world inside this node.
- :func:`measure_in_job`: inside a ``torchrun`` job over one or several nodes (``WORLD_SIZE``, ``RANK``,
  ``LOCAL_WORLD_SIZE`` from torchrun; ranks node-major, as torchrun numbers them). Inside each node: group sizes
  2..per-node over NVLink (every node at once); across nodes: one group per local rank holding that local rank of
  every node (the rails, all at once: what each GPU's NIC carries, the ``inter_node_gb_s`` of the calibration,
  :mod:`scaletool.analytic.network`); and the whole job, to set against the hierarchical model.

The figure kept per op and group size is the largest message's (the bandwidth regime the training collectives of
FSDP2 and ZeRO run in); every message's is kept under ``by_message``.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from scaletool.analytic.collectives import wire_bytes
from scaletool.errors import RecipeError
from scaletool.stats import spread

WARMUP, REPS = 3, 10
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
#: message sizes measured by default: on GPUs from latency- to bandwidth-bound, on the CPU one small size (CI)
GPU_MESSAGES = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
CPU_MESSAGES = (1 << 20,)
#: starts of the local processes before a failure stands: a gloo or NCCL process that dies once on a busy host
#: is not what is measured (calibrate's TP probe starts its processes as often)
SPAWN_ATTEMPTS = 3
T = TypeVar("T")


def _call(op: str, x: torch.Tensor, out: torch.Tensor, group) -> None:
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":  # torch >= 2.13 names it all_gather_single
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x, group=group)
    elif op == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x, group=group)
    else:
        dist.all_to_all_single(out, x, group=group)


def _time_op(op: str, ranks: int, message: int, device: torch.device, group) -> list[float]:
    """Seconds per call of ``op`` on a ``message``-byte message (the full tensor), each call between barriers."""
    elems = message // 4 // ranks * ranks
    shard = elems // ranks
    x = torch.ones(shard if op == "all_gather" else elems, device=device)
    out = torch.empty(shard if op == "reduce_scatter" else elems, device=device)
    secs = []
    for i in range(WARMUP + REPS):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        _call(op, x, out, group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP:
            secs.append(time.perf_counter() - t0)
    return secs


def _measure_group(group, member: bool, ranks: int, messages: tuple[int, ...], ops: tuple[str, ...],
                   device: torch.device, out: dict, skipped: dict) -> None:
    """Every op at every message size on ``group`` (``member``: this rank is in it), into ``out[op]``."""
    if not member:
        return
    for op in ops:
        if op in skipped:
            continue
        by_message = {}
        try:
            for message in messages:
                secs = _time_op(op, ranks, message, device, group)
                wire = wire_bytes(op, message // 4 // ranks * ranks * 4, ranks)
                by_message[message] = {"seconds": spread(secs).model_dump(),
                                       "bus_gb_s": spread([wire / s / 1e9 for s in secs if s > 0]).model_dump()}
        except (RuntimeError, NotImplementedError) as e:  # an op the backend lacks (gloo)
            skipped[op] = str(e).splitlines()[0][:200]
            continue
        largest = by_message[max(by_message)]
        out.setdefault(op, {})[ranks] = {**largest, "by_message": by_message}


def _device_and_backend(local_rank: int, local_world: int) -> tuple[torch.device, str]:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return device, "nccl" if cuda else "gloo"


def _measure(rank: int, world: int, per_node: int, device: torch.device, messages: tuple[int, ...],
             ops: tuple[str, ...]) -> dict:
    """The measurements of an initialised default process group of ``world`` ranks, ``per_node`` on each node
    (node-major); every rank calls this (group creation is collective), rank 0's view is returned."""
    nodes = world // per_node
    node, local = divmod(rank, per_node)
    res: dict = {"backend": dist.get_backend(), "world_size": world, "nodes": nodes, "per_node": per_node,
                 "messages": list(messages), "ops": {}, "inter_node": {}, "world": {}, "skipped": {}}
    for ranks in range(2, per_node + 1):  # inside each node, all nodes at once
        groups = [dist.new_group([n * per_node + i for i in range(ranks)]) for n in range(nodes)]
        _measure_group(groups[node], local < ranks, ranks, messages, ops, device, res["ops"], res["skipped"])
        dist.barrier()
    if nodes > 1:
        rails = [dist.new_group([n * per_node + i for n in range(nodes)]) for i in range(per_node)]
        _measure_group(rails[local], True, nodes, messages, ops, device, res["inter_node"], res["skipped"])
        dist.barrier()
        _measure_group(None, True, world, messages, ops, device, res["world"], res["skipped"])
        dist.barrier()
    return res


def _worker(rank: int, world: int, store: str, result: str, messages: tuple[int, ...], ops: tuple[str, ...]) -> None:
    device, backend = _device_and_backend(rank, world)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        out = _measure(rank, world, world, device, messages, ops)
        if rank == 0:
            Path(result).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def default_messages() -> tuple[int, ...]:
    return GPU_MESSAGES if torch.cuda.is_available() else CPU_MESSAGES


def measure_collectives(world: int, messages: tuple[int, ...] | None = None, ops: tuple[str, ...] = OPS) -> dict:
    """Start ``world`` local processes and measure every op for group sizes 2..world at each message size; the
    medians with p10/p90 and n by op and group size (ops the backend lacks listed under ``skipped``). Processes
    that fail are started again (:func:`start_again`; each failure's line under ``failed_attempts``)."""
    if world < 2:
        return {}
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < world:
        raise RecipeError(f"--gpus {world}: this machine has {torch.cuda.device_count()} GPU(s)")
    messages = tuple(messages or default_messages())

    def start() -> dict:
        with tempfile.TemporaryDirectory(prefix="scaletool-calibrate-") as tmp:  # a fresh store each start
            store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
            mp.start_processes(_worker, args=(world, store, result, messages, ops), nprocs=world, join=True,
                               start_method="spawn")
            return json.loads(Path(result).read_text())

    out, failures = start_again(start)
    return {**out, "failed_attempts": failures} if failures else out


def failure_line(e: BaseException) -> str:
    """What a failed start said last (the child's exception line), at most 200 characters."""
    text = str(e).strip()
    return text.splitlines()[-1][:200] if text else type(e).__name__


def start_again(start: Callable[[], T]) -> tuple[T, list[str]]:
    """``start()`` (local processes that meet and measure) started again while its processes fail, SPAWN_ATTEMPTS
    starts in all: its result and each failed start's :func:`failure_line`. When every start fails, the last
    ProcessException is raised with ``failed_attempts`` set to those lines."""
    failures: list[str] = []
    while True:
        try:
            return start(), failures
        except ProcessException as e:
            failures.append(failure_line(e))
            if len(failures) == SPAWN_ATTEMPTS:
                e.failed_attempts = failures
                raise


def job_layout(environ=None) -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, ranks per node) of the torchrun job this process is in, None outside one
    (or in a one-process job); a RecipeError when the variables do not describe whole nodes."""
    e = os.environ if environ is None else environ
    try:
        world = int(e.get("WORLD_SIZE", "1"))
        if world < 2:
            return None
        rank, local, per_node = int(e["RANK"]), int(e["LOCAL_RANK"]), int(e["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise RecipeError("WORLD_SIZE is set but RANK, LOCAL_RANK or LOCAL_WORLD_SIZE is missing or not a number: "
                          "start a calibration across nodes with torchrun") from None
    if per_node < 1 or world % per_node or not (0 <= rank < world) or not (0 <= local < per_node):
        raise RecipeError(f"torchrun job of {world} ranks with {per_node} per node: not whole nodes (every node "
                          "needs the same --nproc-per-node)")
    return rank, world, local, per_node


def measure_in_job(messages: tuple[int, ...] | None = None, ops: tuple[str, ...] = OPS,
                   timeout_s: int = 600) -> tuple[int, dict]:
    """Measure inside this torchrun job (:func:`job_layout`): (this rank, rank 0's measurements; {} elsewhere)."""
    rank, world, local, per_node = job_layout()
    device, backend = _device_and_backend(local, per_node)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        out = _measure(rank, world, per_node, device, tuple(messages or default_messages()), ops)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rank, out if rank == 0 else {}
