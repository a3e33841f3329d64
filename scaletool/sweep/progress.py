"""How a running sweep shows progress: a rich bar on a terminal, plain lines anywhere else.

A piped or redirected stderr (a log file, CI, ``2>&1 | tee``) cannot redraw a bar: rich would leave
one frozen line. There, every finished run prints one line with the counts so far, the elapsed time
and an estimate of the time left.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape

from scaletool.results.sweep import SweepRecord

STATUS_STYLE = {"ok": "green", "skipped": "dim", "oom": "magenta", "timeout": "yellow", "error": "red"}


def headline(rec: SweepRecord | dict) -> str:
    """One line saying why a run is not ok: the skip reason, the timeout, or the error's last line
    (of a record, or of a record as a dict, as the report reads them)."""
    get = rec.get if isinstance(rec, dict) else (lambda k: getattr(rec, k, None))
    text = (get("reason") or get("error") or "").strip()
    if not text:
        return ""
    lines = text.splitlines()
    return lines[0] if get("status") == "timeout" else lines[-1]


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def run_name(rec: SweepRecord) -> str:
    return f"{rec.mode}{f' #{rec.repeat + 1}/{rec.repeats}' if rec.repeats > 1 else ''} {rec.label}"


class Display:
    """Progress of ``total`` runs; ``finished`` prints a record's line (and the bar or counts)."""

    def __init__(self, console: Console, total: int):
        self.console = console
        self.total = total
        self.done = 0
        self.counts: Counter[str] = Counter()
        self.t0 = time.monotonic()
        self._bar = None
        self._task = None
        self.running: list[str] = []

    def record_line(self, rec: SweepRecord) -> str:
        why = headline(rec)
        took = f" {rec.wall_s:.1f} s" if rec.wall_s is not None else ""
        return (f"[{STATUS_STYLE[rec.status]}]{rec.status:>7}[/] {escape(run_name(rec))}{took}"
                + (f"  [dim]{escape(why[:160])}[/]" if why else ""))

    def skipped(self, rec: SweepRecord) -> None:
        """A point that does not validate: recorded without running, not part of the count."""
        self.console.print(self.record_line(rec), highlight=False)

    def started(self, name: str) -> None:
        self.running.append(name)
        self._describe()

    def finished(self, name: str, rec: SweepRecord) -> None:
        if name in self.running:
            self.running.remove(name)
        self.done += 1
        self.counts[rec.status] += 1
        if self._bar is None:
            elapsed = time.monotonic() - self.t0
            eta = elapsed / self.done * (self.total - self.done)
            counts = ", ".join(f"{n} {s}" for s, n in self.counts.items())
            self.console.print(f"[{self.done}/{self.total}] " + self.record_line(rec)
                               + f"  ({escape(counts)}; elapsed {_clock(elapsed)}, ETA {_clock(eta)})",
                               highlight=False, soft_wrap=True)
            return
        self._bar.console.print(self.record_line(rec), highlight=False)
        self._bar.update(self._task, advance=1, last=rec.status)
        self._describe()

    def _describe(self) -> None:
        if self._bar is None:
            return
        more = f" (+{len(self.running) - 1} more)" if len(self.running) > 1 else ""
        self._bar.update(self._task, description=escape((self.running[0] if self.running else "") + more))
        self._bar.refresh()

    def tick(self) -> None:
        if self._bar is not None:
            self._bar.refresh()


@contextlib.contextmanager
def display(console: Console, total: int) -> Iterator[Display]:
    """A :class:`Display`: with a live bar when ``console`` is a terminal, plain lines otherwise."""
    d = Display(console, total)
    if not console.is_terminal or total == 0:
        yield d
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("last: {task.fields[last]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, auto_refresh=False) as bar:
        d._bar, d._task = bar, bar.add_task("", total=total, last="-")
        yield d
