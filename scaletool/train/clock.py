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


def synchronize(device: torch.device, world_size: int) -> None:
    """Wait for this device's queued work, then for every rank (a measurement boundary)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and world_size > 1:
        dist.barrier()


class Clock:
    """Step marks and the measured window of one training process."""

    def __init__(self, device: torch.device, per_step: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.per_step = per_step
        self._prev = None
        self._marks: list = []
        self._skipped: set[int] = set()
        self.begin: float | None = None  # perf_counter at the start of the measured window
        self.end: float | None = None
        self.excluded_s = 0.0  # unmeasured time inside the window

    def _event(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def restart(self) -> None:
        """Start timing the first step from now (forgetting any earlier mark)."""
        if self.per_step:
            self._prev, self._marks, self._skipped = self._event(), [], set()

    def mark(self) -> None:
        """End of a step (and start of the next)."""
        if not self.per_step:
            return
        ev = self._event()
        if self._prev is None:
            self._prev = ev
        else:
            self._marks.append(ev)

    def skip(self) -> None:
        """Time the next step from here: what ran since the last mark belongs to no step."""
        if not self.per_step:
            return
        self.mark()
        if self._marks:
            self._skipped.add(len(self._marks) - 1)

    def fetch(self, n: int) -> list[float | None]:
        """Seconds of each of the ``n`` steps marked since the last fetch (may wait for the device)."""
        if not self.per_step:
            return [None] * n
        out, prev = [], self._prev
        if self.cuda and self._marks:
            self._marks[-1].synchronize()
        for i, ev in enumerate(self._marks):
            if i not in self._skipped:
                out.append(prev.elapsed_time(ev) / 1e3 if self.cuda else ev - prev)
            prev = ev
        self._prev, self._marks, self._skipped = prev, [], set()
        return out

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
