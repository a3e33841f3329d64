"""Per-step timing without host synchronisation inside the timed loop.

:class:`StepTimer` times each step separately: on CUDA one pair of events recorded on the current
stream around every step (device time between the step's first and last kernel, launch gaps inside
the step included), all read after a single synchronisation at the end; on CPU, whose operators are
synchronous, ``time.perf_counter`` around every step. The per-step samples then go through
``scaletool.stats`` (warm-up rule, median with p10/p90).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StepTimer:
    """Collects the duration of each ``with timer.step():`` block; :meth:`seconds` reads them all."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._pairs: list[tuple] = []

    @contextmanager
    def step(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._pairs.append((start, end))

    def seconds(self) -> list[float]:
        """Every step's seconds, in order (on CUDA: waits once, for the last step's end event)."""
        if not self._pairs:
            return []
        if self.cuda:
            self._pairs[-1][1].synchronize()
            return [s.elapsed_time(e) / 1e3 for s, e in self._pairs]
        return [e - s for s, e in self._pairs]
