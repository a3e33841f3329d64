"""Per-step timing without host synchronisation inside the timed loop: the one step timer of the package.

:class:`StepTimer` keeps marks on a timeline: on CUDA an event recorded on the current stream (no
synchronisation), on the CPU, whose operators are synchronous, ``time.perf_counter``. A step is the time
between two consecutive marks; :meth:`StepTimer.skip` marks a point whose preceding interval belongs to no
step (a checkpoint, a monitor, bookkeeping), and :meth:`StepTimer.step` times one block on its own (a skip
at its start, a mark at its end). :meth:`StepTimer.fetch` reads the steps marked so far after a single
synchronisation, for the last mark; the samples then go through ``scaletool.stats`` (warm-up rule, median
with p10/p90). The training loop marks the end of every step (so data loading between steps counts); the
decode benchmark times each step as a block. With a :class:`~scaletool.measure.contention.Probe`, each
mark also snapshots what the kernel says of the host (CPU time, run-queue delay, CPU pressure, steal), and
:attr:`StepTimer.contention` holds one sample per step of the last fetch.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StepTimer:
    """Marks on a timeline; the intervals between them are step durations."""

    def __init__(self, device: torch.device, probe=None):
        self.cuda = torch.device(device).type == "cuda"
        self.probe = probe
        self._prev = None  # the mark the next step starts from
        self._marks: list = []
        self._skipped: set[int] = set()  # indices into _marks whose interval belongs to no step
        self._prev_snap = None
        self._snaps: list = []  # the probe's snapshot at each mark
        self.contention: list[dict] = []  # per step of the last fetch (empty without a probe)

    def _snap(self):
        return self.probe.snap() if self.probe is not None else None

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def restart(self) -> None:
        """Time the next step from now, forgetting any mark not yet fetched."""
        self._prev, self._marks, self._skipped = self._now(), [], set()
        self._prev_snap, self._snaps = self._snap(), []

    def mark(self) -> None:
        """The end of a step (and the start of the next)."""
        ev, snap = self._now(), self._snap()
        if self._prev is None:
            self._prev, self._prev_snap = ev, snap
        else:
            self._marks.append(ev)
            self._snaps.append(snap)

    def skip(self) -> None:
        """Time the next step from here: what ran since the last mark belongs to no step."""
        self.mark()
        if self._marks:
            self._skipped.add(len(self._marks) - 1)

    @contextmanager
    def step(self):
        """Time the body as one step of its own (whatever ran before it is no step's)."""
        self.skip()
        yield
        self.mark()

    def fetch(self) -> list[float]:
        """Seconds of each step marked since the last fetch, in order (on CUDA: waits once, for the last mark)."""
        out, prev, prev_snap, self.contention = [], self._prev, self._prev_snap, []
        if self.cuda and self._marks:
            self._marks[-1].synchronize()
        for i, (ev, snap) in enumerate(zip(self._marks, self._snaps)):
            if i not in self._skipped:
                out.append(prev.elapsed_time(ev) / 1e3 if self.cuda else ev - prev)
                if self.probe is not None:
                    self.contention.append(self.probe.between(prev_snap, snap))
            prev, prev_snap = ev, snap
        self._prev, self._marks, self._skipped = prev, [], set()
        self._prev_snap, self._snaps = prev_snap, []
        return out

    def seconds(self) -> list[float]:
        """Every step timed so far (see :meth:`fetch`)."""
        return self.fetch()


def graph_replay_seconds(graph, runs: int, warmup: int = 3, per: int = 1) -> list[float]:
    """Seconds of each of ``runs`` replays of a captured CUDA graph, after ``warmup`` untimed ones, divided by
    ``per`` (the calls captured in it): one event pair around each replay, read once it has ended (what the
    benchmark scripts time kernels of a few microseconds with, without the host's launches)."""
    out = []
    for i in range(warmup + runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= warmup:
            out.append(a.elapsed_time(b) / 1e3 / per)
    return out
