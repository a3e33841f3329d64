"""Memory a run may still allocate on a device, before it allocates: count and decode refuse a run
that cannot fit with its figures instead of being killed midway."""
from __future__ import annotations

from typing import Any

import torch


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


#: where the CPU's available memory is read (tests point them at files of their own)
MEMINFO = "/proc/meminfo"
CGROUP_DIR = "/sys/fs/cgroup"


def available_memory(device: Any) -> tuple[int | None, str | None]:
    """Bytes a count may still allocate on ``device``, and where the figure comes from (None: unknown).

    CUDA: the free memory of the GPU (``torch.cuda.mem_get_info``). CPU: the kernel's
    MemAvailable (/proc/meminfo), or the cgroup's remaining limit (memory.max - memory.current, cgroup v2)
    when that is smaller: a container is OOM-killed at its limit, whatever the host has free.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0], "free memory of the GPU (torch.cuda.mem_get_info)"
    found = []
    try:
        for line in open(MEMINFO):
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    limit, used = _read_int(f"{CGROUP_DIR}/memory.max"), _read_int(f"{CGROUP_DIR}/memory.current")
    if limit is not None and used is not None:
        found.append((max(0, limit - used), "this cgroup's memory.max - memory.current"))
    return min(found) if found else (None, None)
