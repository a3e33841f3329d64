"""Run a sweep: every (point, mode) in its own process group, with a timeout, recorded as it finishes.

Each run is ``python -m scaletool MODE <point>/recipe.yaml --json [args]`` (``sys.executable``, never
the ``scaletool`` script, which is not installed everywhere the package runs). Its stdout and stderr
go to files in the run directory, its JSON becomes the record's ``result``. A run that exceeds its
timeout has its whole process group terminated (SIGTERM, then SIGKILL), so launcher workers die
with it; whatever happens to one run, the next one starts.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from scaletool.sweep.points import Point, expand
from scaletool.sweep.spec import Sweep
from scaletool.sweep.store import append_record, latest_by_key, read_records

OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|MemoryError|can't allocate memory|"
                      r"Cannot allocate memory|std::bad_alloc", re.IGNORECASE)
TERM_GRACE_S = 10.0  # between SIGTERM and SIGKILL on timeout: lets a launcher stop its workers
POLL_S = 0.25
ERROR_TAIL_CHARS = 4000
SWEEP_META = "sweep.json"


@dataclass
class Task:
    """One (point, mode) of the plan and what the results store already says about it."""

    point: Point
    mode: str
    key: str
    args: list[str]
    previous: dict | None

    @property
    def state(self) -> str:
        """skipped (the point does not validate), pending, done (ok) or failed (any other status,
        a launch-time skip included: a fixed data file or launcher makes it worth a --retry-failed)."""
        if self.point.skipped:
            return "skipped"
        if self.previous is None:
            return "pending"
        return "done" if self.previous["status"] == "ok" else "failed"


def plan(sweep: Sweep, results_dir: Path, modes: list[str] | None = None) -> tuple[list[Task], list[str]]:
    """Every (point, mode) of the sweep with its previous record; warnings from reading the store."""
    records, warnings = read_records(results_dir)
    latest = latest_by_key(records)
    tasks = []
    for point in expand(sweep):
        for mode in sweep.spec.modes:
            if modes and mode not in modes:
                continue
            args = sweep.mode_args(mode)
            key = point.key(mode, args)
            tasks.append(Task(point, mode, key, args, latest.get(key)))
    return tasks, warnings


def to_run(tasks: list[Task], retry_failed: bool) -> list[Task]:
    """The tasks a run executes: pending ones, failed ones with --retry-failed; skipped ones not yet recorded."""
    return [t for t in tasks if t.state == "pending" or (t.state == "failed" and retry_failed)
            or (t.state == "skipped" and t.previous is None)]


def write_meta(sweep: Sweep, results_dir: Path) -> None:
    """results_dir/sweep.json: what the report needs to name and describe this results dir."""
    meta = {"name": sweep.name, "label": sweep.spec.label, "description": sweep.spec.description,
            "sweep_file": str(sweep.path.resolve()), "base_recipe": str(sweep.base_recipe_path),
            "modes": list(sweep.spec.modes), "spec": sweep.spec.model_dump(mode="json")}
    tmp = results_dir / (SWEEP_META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, results_dir / SWEEP_META)


def base_record(task: Task, sweep: Sweep) -> dict:
    p = task.point
    return {
        "key": task.key, "point_id": p.point_id, "mode": task.mode, "sweep": sweep.name, "index": p.index,
        "label": p.label, "values": p.values, "match_params": p.match_params,
        "recipe": p.recipe.to_dict() if p.recipe is not None else None,
    }


def skipped_record(task: Task, sweep: Sweep) -> dict:
    return {**base_record(task, sweep), "status": "skipped", "reason": task.point.reason}


def run_task(task: Task, sweep: Sweep, results_dir: Path, *, timeout_s: float | None = None,
             tick: Callable[[], None] = lambda: None) -> dict:
    """Run one (point, mode) to completion or timeout and return its record (not yet stored)."""
    point_dir = results_dir / "points" / task.point.dirname
    run_dir = point_dir / task.mode
    if run_dir.exists():  # a run that was interrupted or is being retried: start clean
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    recipe_path = point_dir / "recipe.yaml"
    # The recipe as written, not resolved: a command may treat keys a recipe sets differently from
    # defaults (train rejects an explicit parallel.zero_stage under engine=single).
    recipe_path.write_text(yaml.safe_dump(task.point.raw, sort_keys=False))
    argv = [sys.executable, "-m", "scaletool", task.mode, str(recipe_path), "--json", *task.args]
    if task.mode == "train":
        argv += ["--out", str(run_dir)]
    timeout = timeout_s if timeout_s is not None else sweep.timeout(task.mode)
    started = datetime.now(timezone.utc)
    with open(run_dir / "stdout.log", "wb") as out, open(run_dir / "stderr.log", "wb") as err:
        rc, timed_out, wall = run_process(argv, out, err, timeout, tick)
    stdout = (run_dir / "stdout.log").read_text(errors="replace")
    stderr = (run_dir / "stderr.log").read_text(errors="replace")
    status, why, result = classify(rc, timed_out, timeout, stdout, stderr)
    return {**base_record(task, sweep), "status": status, "reason" if status == "skipped" else "error": why,
            "result": result, "returncode": rc, "wall_s": round(wall, 3),
            "started_at": started.isoformat(timespec="seconds"), "run_dir": str(run_dir.relative_to(results_dir)),
            "argv": argv}


def run_process(argv: list[str], out, err, timeout: float, tick: Callable[[], None]) -> tuple[int, bool, float]:
    """Run ``argv`` in a new session (its own process group); kill the group on timeout or interrupt.

    Returns (return code, timed out, wall seconds). Polls instead of blocking so the progress display
    keeps its clock running without a refresh thread (no threads: safe to fork with a preexec_fn).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent)
    timed_out = False
    try:
        while True:
            try:
                rc = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > timeout:
                    timed_out = True
                    _kill_group(proc, signal.SIGTERM)
                    try:
                        rc = proc.wait(timeout=TERM_GRACE_S)
                    except subprocess.TimeoutExpired:
                        _kill_group(proc, signal.SIGKILL)
                        rc = proc.wait()
                    break
                tick()
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): take the point's processes with us
        _kill_group(proc, signal.SIGKILL)
        proc.wait()
        raise
    _kill_group(proc, signal.SIGKILL)  # stragglers: workers a launcher left behind
    return rc, timed_out, time.monotonic() - t0


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


if sys.platform == "linux":
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)
    _PR_SET_PDEATHSIG = 1

    def _die_with_parent() -> None:
        """In the child: get SIGKILL when the sweep dies, even by SIGKILL (which no handler sees)."""
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
else:  # elsewhere an orphaned run finishes on its own; its record is simply never written
    _die_with_parent = None


def classify(rc: int, timed_out: bool, timeout: float, stdout: str, stderr: str) -> tuple[str, str | None, object]:
    """(status, error text or skip reason, parsed JSON result) of a finished run.

    A failed run keeps whatever JSON it printed (train prints its partial summary on failure).
    """
    tail = stderr[-ERROR_TAIL_CHARS:].strip()
    result = parse_json(stdout)
    if timed_out:
        return "timeout", f"exceeded timeout of {timeout:g} s" + (f"\n{tail}" if tail else ""), result
    if rc == 0:
        if result is None:
            return "error", "exited 0 but printed no JSON on stdout" + (f"\n{tail}" if tail else ""), None
        return "ok", None, result
    if rc == 2 and tail and all(line.startswith("error: ") for line in tail.splitlines()):
        # a RecipeError the command found at launch (exit 2, one `error:` line per problem): the
        # combination is invalid for this mode, like a point that fails validation
        return "skipped", "; ".join(line[len("error: "):] for line in tail.splitlines()), result
    if OOM_TEXT.search(stderr[-20000:]):
        return "oom", tail or "out of memory", result
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = " (the kernel's OOM killer sends SIGKILL too)" if -rc == signal.SIGKILL else ""
        return "error", f"killed by {name}{why}" + (f"\n{tail}" if tail else ""), result
    return "error", tail or f"exit status {rc}", result


def parse_json(text: str):
    """The JSON document on stdout; tolerates lines printed before it (the document starts a line)."""
    text = text.strip()
    if not text:
        return None
    starts = [0] + [m.start() for m in re.finditer(r"^[\[{]", text, re.MULTILINE)]
    for s in starts:
        try:
            return json.loads(text[s:])
        except json.JSONDecodeError:
            continue
    return None


def headline(rec: dict) -> str:
    """One line saying why a run is not ok: the skip reason, the timeout, or the error's last line."""
    text = (rec.get("reason") or rec.get("error") or "").strip()
    if not text:
        return ""
    lines = text.splitlines()
    return lines[0] if rec["status"] == "timeout" else lines[-1]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (a scheduler's preemption, `kill`) unwinds like Ctrl-C, so the running point is killed."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


STATUS_STYLE = {"ok": "green", "skipped": "dim", "oom": "magenta", "timeout": "yellow", "error": "red"}


def execute(sweep: Sweep, results_dir: Path, *, retry_failed: bool = False, modes: list[str] | None = None,
            console=None) -> dict:
    """Run what the results store lacks (see :func:`to_run`), recording each run as it ends; the summary."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = console or Console(stderr=True)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    tasks, warnings = plan(sweep, results_dir, modes)
    for w in warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    write_meta(sweep, results_dir)
    todo = to_run(tasks, retry_failed)
    final = {t.key: t.previous for t in tasks if t.previous is not None}

    def record(rec: dict, progress=None) -> None:
        append_record(results_dir, rec)
        final[rec["key"]] = rec
        style = STATUS_STYLE[rec["status"]]
        why = headline(rec)
        took = f" {rec['wall_s']:.1f} s" if "wall_s" in rec else ""
        line = (f"[{style}]{rec['status']:>7}[/] {rec['mode']:<8} {escape(rec['label'])}{took}"
                + (f"  [dim]{escape(why[:160])}[/]" if why else ""))
        (progress.console if progress else console).print(line)

    for t in todo:
        if t.state == "skipped":
            record(skipped_record(t, sweep))
    runs = [t for t in todo if t.state != "skipped"]
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("last: {task.fields[last]}"), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    with _sigterm_interrupts(), Progress(*columns, console=console, auto_refresh=False) as progress:
        bar = progress.add_task("", total=len(runs), last="-")
        for t in runs:
            progress.update(bar, description=escape(f"{t.mode} {t.point.label}"))
            progress.refresh()
            rec = run_task(t, sweep, results_dir, tick=progress.refresh)
            record(rec, progress)
            progress.update(bar, advance=1, last=rec["status"])
            progress.refresh()

    counts = {s: 0 for s in STATUS_STYLE}
    rows = []
    for t in tasks:
        rec = final.get(t.key)
        status = rec["status"] if rec else "pending"
        counts[status] = counts.get(status, 0) + 1
        rows.append({"key": t.key, "label": t.point.label, "mode": t.mode, "status": status,
                     "wall_s": rec.get("wall_s") if rec else None,
                     "error": headline(rec) if rec else None})
    return {"sweep": sweep.name, "results_dir": str(results_dir), "points": len({t.point.index for t in tasks}),
            "runs": len(tasks), "ran_now": len(runs), "status_counts": counts, "warnings": warnings,
            "results": rows}
