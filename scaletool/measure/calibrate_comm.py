"""Bus bandwidth of all-gather, reduce-scatter, all-reduce and all-to-all over 2..N local processes (NCCL on
GPUs, gloo on the CPU), the figure the step-time model divides wire bytes by (NCCL's bus bandwidth
convention: wire bytes per rank over time). Processes start with ``torch.multiprocessing`` and meet
through a file store in a private temporary directory; rank 0 writes the medians to a JSON file there.
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletool.analytic.collectives import wire_bytes
from scaletool.errors import RecipeError
from scaletool.stats import spread

WARMUP, REPS = 3, 10


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
    import time
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


def _worker(rank: int, world: int, store: str, result: str, message: int, ops: tuple[str, ...]) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    out: dict = {"backend": backend, "world_size": world, "message_bytes": message, "ops": {}, "skipped": {}}
    try:
        for ranks in range(2, world + 1):
            group = dist.new_group(list(range(ranks)))
            for op in ops:
                if rank >= ranks:
                    continue
                try:
                    secs = _time_op(op, ranks, message, device, group)
                except (RuntimeError, NotImplementedError) as e:  # an op the backend lacks (gloo)
                    out["skipped"][op] = str(e).splitlines()[0][:200]
                    continue
                wire = wire_bytes(op, message // 4 // ranks * ranks * 4, ranks)
                out["ops"].setdefault(op, {})[ranks] = {
                    "seconds": spread(secs).model_dump(),
                    "bus_gb_s": spread([wire / s / 1e9 for s in secs if s > 0]).model_dump()}
            dist.barrier()
        if rank == 0:
            Path(result).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, message: int | None = None,
                        ops: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")) -> dict:
    """Start ``world`` local processes and measure every op for group sizes 2..world; the medians with
    p10/p90 and n by op and group size (ops the backend lacks listed under ``skipped``)."""
    if world < 2:
        return {}
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < world:
        raise RecipeError(f"--gpus {world}: this machine has {torch.cuda.device_count()} GPU(s)")
    message = message or ((256 << 20) if cuda else (1 << 20))
    with tempfile.TemporaryDirectory(prefix="scaletool-calibrate-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(world, store, result, message, ops), nprocs=world, join=True,
                           start_method="spawn")
        return json.loads(Path(result).read_text())
