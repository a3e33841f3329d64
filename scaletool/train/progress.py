"""Progress of the training steps on stderr: a rich bar on a terminal, plain lines when piped.

A live bar redrawn into a pipe or a log file leaves one frozen line; there, a plain line is printed
at every tenth of the run instead, at most every ``min_interval_s`` (a run of a few seconds prints none).
"""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class StepProgress:
    """``with StepProgress(...) as p: ... p.advance()`` once per step."""

    def __init__(self, console: Console, total: int, done: int, *, enabled: bool, min_interval_s: float = 5.0):
        self.console, self.total, self.done, self.first = console, total, done, done
        self.enabled = enabled and total > done
        self.live = self.enabled and console.is_terminal
        self.every = max(1, (total - done) // 10)
        self.min_interval_s = min_interval_s
        self._bar = self._task = None
        self._t0 = self._last = 0.0

    def __enter__(self) -> StepProgress:
        self._t0 = self._last = time.perf_counter()
        if self.live:
            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
            return
        now = time.perf_counter()
        due = self.done % self.every == 0 or self.done == self.total
        if self.enabled and due and now - self._last >= self.min_interval_s:
            self._last = now
            self.console.print(self.line(now - self._t0), markup=False, highlight=False)

    def line(self, elapsed_s: float) -> str:
        """``progress: 40/100 steps (40%), 12 s elapsed, about 18 s left``."""
        ran = self.done - self.first
        text = f"progress: {self.done}/{self.total} steps ({100 * self.done / self.total:.0f}%), {elapsed_s:.0f} s elapsed"
        if ran > 0 and self.done < self.total:
            text += f", about {elapsed_s / ran * (self.total - self.done):.0f} s left"
        return text
