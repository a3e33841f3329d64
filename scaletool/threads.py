"""CPU threads: every CPU-side process gets its share of the cores, never torch's default of all of them.

Two processes on two cores that each start torch's default thread pool oversubscribe the cores and
measure nothing (a tiny model ran 1.9k tokens/s so, 19-25k tokens/s with one thread each). The rule:

- a process may use the cores in its affinity mask (``os.sched_getaffinity``), or the share its parent
  gave it in ``SCALETOOL_CPU_THREADS`` (a sweep running several points at once divides the cores);
- ranks started on one node divide that share among themselves;
- :func:`pin_threads` sets torch's intra-op threads to the result; a launcher gives each child its
  share with :func:`child_env`; a run records the count it used.

An ``OMP_NUM_THREADS`` the user set explicitly wins over the computed share (their decision).
"""
from __future__ import annotations

import os

#: the number of cores a parent hands to this process (and its ranks)
SHARE_ENV = "SCALETOOL_CPU_THREADS"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _positive_int(value: str | None) -> int | None:
    try:
        n = int(value) if value is not None else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None


def cpu_share(environ: dict | None = None) -> int:
    """The cores this process and its ranks may use together."""
    e = os.environ if environ is None else environ
    return _positive_int(e.get(SHARE_ENV)) or available_cores()


def threads_per_process(ranks: int = 1, environ: dict | None = None) -> int:
    """Intra-op threads for one of ``ranks`` processes sharing this process's cores (at least 1);
    an explicit ``OMP_NUM_THREADS`` wins."""
    e = os.environ if environ is None else environ
    explicit = _positive_int(e.get("OMP_NUM_THREADS"))
    if explicit is not None:
        return explicit
    return max(1, cpu_share(e) // max(1, ranks))


def child_env(threads: int) -> dict[str, str]:
    """Environment that gives a child process (and its OpenMP/MKL pools) ``threads`` cores."""
    t = str(max(1, int(threads)))
    return {SHARE_ENV: t, "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}


def pin_threads(ranks: int = 1) -> int:
    """Set torch's intra-op threads for this process (one of ``ranks`` on its cores); return the count."""
    import torch

    n = threads_per_process(ranks)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
