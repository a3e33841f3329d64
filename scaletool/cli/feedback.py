"""Progress of a long command on stderr: a rich bar with the time left on a terminal, plain lines when piped.

A command hands its work a callback ``report(done, total, description, detail=None)``: ``done`` of
``total`` units (fractions allowed; ``total`` None while the amount is unknown, e.g. building a model),
``description`` the stage (a new one is a new plain line), ``detail`` what happens inside it (shown on the
bar; on a pipe at most every ``interval_s``, with the time elapsed and, where it can be told, the time left).
stdout is never written, so ``--json`` output stays one JSON document.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import click
from rich.console import Console


class PlainLines:
    """The piped form: a line per new stage, a detail line at most every ``interval_s``."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.description: str | None = None
        self.t0 = self.last = time.perf_counter()
        self.start: tuple[float, float] | None = None  # (time, done) of the first report with a known total

    def __call__(self, done: float, total: float | None, description: str, detail: str | None = None) -> None:
        now = time.perf_counter()
        if total is not None and self.start is None:
            self.start = (now, done)
        if description != self.description:
            self.description, self.last = description, now
            click.echo(description, err=True)
        elif detail and now - self.last >= self.interval_s:
            self.last = now
            click.echo(f"{description}: {detail} ({self.timing(now, done, total)})", err=True)

    def timing(self, now: float, done: float, total: float | None) -> str:
        text = f"{now - self.t0:.0f} s elapsed"
        if total is not None and self.start is not None and done > self.start[1] and done < total:
            t, d = self.start
            text += f", about {(now - t) / (done - d) * (total - done):.0f} s left"
        return text


@contextmanager
def feedback(enabled: bool = True, interval_s: float = 10.0) -> Iterator:
    """The ``report`` callback for a command's progress (a no-op when not ``enabled``)."""
    err = Console(stderr=True)
    if not enabled:
        yield lambda *a, **k: None
        return
    if not err.is_terminal:
        yield PlainLines(interval_s)
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Column

    # the text gives way on a narrow terminal (cut with …), never the bar's figures
    text = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"))
    with Progress(text, BarColumn(bar_width=16), TaskProgressColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=err, transient=True, expand=True) as bar:
        task = bar.add_task("", total=None)

        def report(done: float, total: float | None, description: str, detail: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=f"{description}: {detail}" if detail else description)

        yield report
