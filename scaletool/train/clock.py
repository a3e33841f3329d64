"""The training clock: per-step durations without host synchronisation, and the measured window.

Per-step times come from CUDA events recorded on the stream (no sync; read at log boundaries,
where the host synchronises anyway) or, on the CPU, the wall clock. The measured window runs from
the first measured step to the end of training, minus the time spent in :meth:`Clock.unmeasured`
(checkpoints, monitors, trace writing), which is also cut out of the step it falls into: the next
step is timed from the end of that work.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from scaletool.measure.timing import StepTimer


def synchronize(device: torch.device, world_size: int) -> None:
    """Wait for this device's queued work, then for every rank (a measurement boundary)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and world_size > 1:
        dist.barrier()


class Clock:
    """Step durations (a :class:`~scaletool.measure.timing.StepTimer`) and the measured window of one
    training process; ``per_step=False`` (``--no-measure``) keeps the window only."""

    def __init__(self, device: torch.device, per_step: bool, probe=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.per_step = per_step
        self._steps = StepTimer(device, probe if per_step else None)
        self.begin: float | None = None  # perf_counter at the start of the measured window
        self.end: float | None = None
        self.excluded_s = 0.0  # unmeasured time inside the window

    def restart(self) -> None:
        """Start timing the first step from now (forgetting any earlier mark)."""
        if self.per_step:
            self._steps.restart()

    def mark(self) -> None:
        """End of a step (and start of the next)."""
        if self.per_step:
            self._steps.mark()

    def skip(self) -> None:
        """Time the next step from here: what ran since the last mark belongs to no step."""
        if self.per_step:
            self._steps.skip()

    def fetch(self, n: int) -> list[float | None]:
        """Seconds of each of the ``n`` steps marked since the last fetch (may wait for the device)."""
        return self._steps.fetch() if self.per_step else [None] * n

    @property
    def contention(self) -> list[dict]:
        """The probe's sample for each step of the last fetch (empty without per-step timing or a probe)."""
        return self._steps.contention if self.per_step else []

    def start_window(self) -> None:
        self.begin = time.perf_counter()

    def stop_window(self) -> None:
        self.end = time.perf_counter()

    @property
    def window_s(self) -> float | None:
        """Measured wall time: the window minus unmeasured work (None before the window opened)."""
        if self.begin is None:
            return None
        return (self.end if self.end is not None else time.perf_counter()) - self.begin - self.excluded_s

    @contextmanager
    def unmeasured(self):
        """Synchronise, run the body, synchronise; its time counts in no step and not in the window."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            if self.begin is not None:
                self.excluded_s += time.perf_counter() - t0
            self.skip()
