"""Run a sweep: every (point, mode, repeat) in its own supervised process, recorded as it finishes.

Each run is ``python -m scaletool --result-file RUN_DIR/result.json MODE RUN_DIR/../recipe.yaml [args]``
(``sys.executable``, never the ``scaletool`` script, which is not installed everywhere the package
runs). The command writes its typed result to that file; the record's ``result`` is read from there
(checked as the result its mode produces), never parsed from stdout. stdout and stderr go to log files
in the run directory. Runs go through :mod:`~scaletool.sweep.pool` (up to ``parallel`` at once, each
on its own cores and GPUs, under a supervisor that takes everything the run started down with it on
a timeout, an interrupt or the sweep's death); whatever happens to one run, the next one starts.

The results directory is locked for the whole sweep (:mod:`~scaletool.sweep.lock`), so the plan read at
the start stays true: no other sweep records, or deletes, anything there meanwhile.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from scaletool.errors import RecipeError
from scaletool.fmt import refuse_link, refused, write_atomic
from scaletool.results import ResultLoadError
from scaletool.results.sweep import STATUSES, RunRow, SweepRecord, SweepSummary, check_result
from scaletool.sweep.lock import results_lock
from scaletool.sweep.points import Point, expand
from scaletool.sweep.pool import Launch, Pool, Run, parse_gpus, visible_gpus
from scaletool.sweep.progress import Display, display, headline, run_name
from scaletool.sweep.spec import Sweep
from scaletool.sweep.store import append_record, latest_by_key, load_records

OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|MemoryError|can't allocate memory|"
                      r"Cannot allocate memory|std::bad_alloc", re.IGNORECASE)
ERROR_TAIL_CHARS = 4000
SWEEP_META = "sweep.json"
RESULT_FILE = "result.json"
POINTS_DIR = "points"


@dataclass
class Task:
    """One (point, mode, repeat) of the plan and what the results store already says about it."""

    n: int  # position in the full plan (all modes): the Slurm array index of this run
    point: Point
    mode: str
    repeat: int
    repeats: int
    key: str
    args: list[str]
    previous: SweepRecord | None

    @property
    def state(self) -> str:
        """skipped (the point does not validate), pending, done (ok) or failed (any other status,
        a launch-time skip included: a fixed data file or launcher makes it worth a --retry-failed)."""
        if self.point.skipped:
            return "skipped"
        if self.previous is None:
            return "pending"
        return "done" if self.previous.status == "ok" else "failed"

    @property
    def run_dirname(self) -> str:
        """``train`` for the first repeat (the layout before repeats existed), ``train-r1``... after it."""
        return self.mode if self.repeat == 0 else f"{self.mode}-r{self.repeat}"

    @property
    def name(self) -> str:
        return f"{self.mode}{f' #{self.repeat + 1}/{self.repeats}' if self.repeats > 1 else ''} {self.point.label}"


def plan(sweep: Sweep, results_dir: Path) -> tuple[list[Task], list[str]]:
    """Every (point, mode, repeat) of the sweep with its previous record; warnings from reading the store."""
    records, warnings = load_records(results_dir)
    latest = latest_by_key(records)
    tasks: list[Task] = []
    points = expand(sweep)
    # Repeats go round the points (every point's first run, then every point's second, ...), not back to
    # back: a machine whose speed drifts over minutes (a shared or virtual CPU) then slows every point's
    # runs alike, and the drift shows in each point's spread across its runs instead of between points.
    for r in range(max(sweep.repeats(mode) for mode in sweep.spec.modes)):
        for point in points:
            for mode in sweep.spec.modes:
                if r < (repeats := sweep.repeats(mode)):
                    args = sweep.mode_args(mode)
                    key = point.key(mode, args, r)
                    tasks.append(Task(len(tasks), point, mode, r, repeats, key, args, latest.get(key)))
    return tasks, warnings


def plan_digest(tasks: list[Task]) -> str:
    """Identity of a plan (its run keys in order): a Slurm array task checks it still runs what was submitted."""
    return hashlib.sha256("\n".join(t.key for t in tasks).encode()).hexdigest()[:16]


def select(tasks: list[Task], modes: list[str] | None) -> list[Task]:
    return [t for t in tasks if not modes or t.mode in modes]


def to_run(tasks: list[Task], retry_failed: bool) -> list[Task]:
    """The tasks a run executes: pending ones, failed ones with --retry-failed; skipped ones not yet recorded."""
    return [t for t in tasks if t.state == "pending" or (t.state == "failed" and retry_failed)
            or (t.state == "skipped" and t.previous is None)]


def gpus_needed(sweep: Sweep, mode: str, args: list[str]) -> int:
    """GPUs one run of ``mode`` occupies when GPUs are handed out: train and profile one per rank,
    decode one, count one only when told to build on cuda, estimate none."""
    joined = " ".join(args)
    if mode in ("train", "profile"):
        return sweep.ranks(mode)
    if mode == "decode":
        return 0 if re.search(r"--device[= ]cpu\b", joined) else 1
    if mode == "count":
        return 1 if re.search(r"--device[= ]cuda", joined) else 0
    return 0


def write_meta(sweep: Sweep, results_dir: Path) -> None:
    """results_dir/sweep.json: what the report needs to name and describe this results dir."""
    meta = {"name": sweep.name, "label": sweep.spec.label, "description": sweep.spec.description,
            "sweep_file": str(sweep.path.resolve()), "base_recipe": str(sweep.base_recipe_path),
            "modes": list(sweep.spec.modes), "repeats": sweep.spec.repeats, "spec": sweep.spec.model_dump(mode="json")}
    write_atomic(results_dir / SWEEP_META, json.dumps(meta, indent=2, sort_keys=True) + "\n")


def base_fields(task: Task, sweep: Sweep) -> dict:
    p = task.point
    return {"key": task.key, "point_id": p.point_id, "mode": task.mode, "sweep": sweep.name, "index": p.index,
            "label": p.label, "values": p.values, "match_params": p.match_params,
            "recipe": p.recipe.to_dict() if p.recipe is not None else None,
            "repeat": task.repeat, "repeats": task.repeats}


def skipped_record(task: Task, sweep: Sweep) -> SweepRecord:
    return SweepRecord(**base_fields(task, sweep), status="skipped", reason=task.point.reason)


def prepare(task: Task, sweep: Sweep, results_dir: Path, timeout_s: float | None = None) -> Launch:
    """Create the run's directory (clean: a run interrupted before, or retried, starts over) and its command."""
    point_dir = results_dir / POINTS_DIR / task.point.dirname
    run_dir = point_dir / task.run_dirname
    for d in (results_dir / POINTS_DIR, point_dir, run_dir):  # a planted link would take the rmtree elsewhere
        refuse_link(d)
    if run_dir.exists():  # only this task ever uses this directory, and the lock says no one else runs it
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    recipe_path = point_dir / "recipe.yaml"
    # The recipe as written, not resolved: a command may treat keys a recipe sets differently from
    # defaults (train rejects an explicit parallel.zero_stage under engine=single). Written atomically:
    # parallel repeats of one point write the same file.
    write_atomic(recipe_path, yaml.safe_dump(task.point.raw, sort_keys=False))
    argv = [sys.executable, "-m", "scaletool", "--result-file", str(run_dir / RESULT_FILE), task.mode,
            str(recipe_path), *task.args]
    if task.mode in ("train", "profile"):
        argv += ["--out", str(run_dir)]
    return Launch(argv, run_dir / "stdout.log", run_dir / "stderr.log",
                  timeout_s if timeout_s is not None else sweep.timeout(task.mode),
                  ranks=sweep.ranks(task.mode), gpus_needed=gpus_needed(sweep, task.mode, task.args))


def read_result(path: Path, mode: str) -> tuple[dict | None, str | None]:
    """(the result document, None) or (None, why it cannot be used); (None, None) when none was written."""
    if not path.is_file():
        return None, None
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"{RESULT_FILE}: not valid JSON ({e})"
    try:
        check_result(mode, doc, RESULT_FILE)
    except ResultLoadError as e:
        return None, "; ".join(e.problems[:3])
    return doc, None


def _tail(path: Path, limit: int = 20000) -> str:
    """The last ``limit`` bytes of a log (a long run's log can be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def classify(rc: int, timed_out: bool, timeout: float, result: dict | None, stderr: str,
             problem: str | None = None) -> tuple[str, str | None]:
    """(status, error text or skip reason) of a finished run. A failed run keeps the result it wrote
    (train writes its partial summary on failure); ``problem`` says why a written result was unusable."""
    tail = stderr[-ERROR_TAIL_CHARS:].strip()
    tail = "\n".join(x for x in (problem, tail) if x)
    if timed_out:
        return "timeout", f"exceeded timeout of {timeout:g} s" + (f"\n{tail}" if tail else "")
    if rc == 0:
        if result is None:
            return "error", f"exited 0 but wrote no usable result ({RESULT_FILE})" + (f"\n{tail}" if tail else "")
        return "ok", None
    if rc == 2 and tail and all(line.startswith("error: ") for line in tail.splitlines()):
        # a RecipeError the command found at launch (exit 2, one `error:` line per problem): the
        # combination is invalid for this mode, like a point that fails validation
        return "skipped", "; ".join(line[len("error: "):] for line in tail.splitlines())
    if OOM_TEXT.search(stderr[-20000:]):
        return "oom", tail or "out of memory"
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = " (the kernel's OOM killer sends SIGKILL too)" if -rc == signal.SIGKILL else ""
        return "error", f"killed by {name}{why}" + (f"\n{tail}" if tail else "")
    return "error", tail or f"exit status {rc}"


def finish(task: Task, sweep: Sweep, results_dir: Path, run: Run, started: datetime, **extra) -> SweepRecord:
    """The record of a finished run (not yet stored)."""
    launch = run.launch
    run_dir = launch.stdout.parent
    result, problem = read_result(run_dir / RESULT_FILE, task.mode)
    status, why = classify(run.returncode, run.timed_out, launch.timeout_s, result, _tail(launch.stderr), problem)
    return SweepRecord(**base_fields(task, sweep), status=status, **{"reason" if status == "skipped" else "error": why},
                       result=result, returncode=run.returncode, wall_s=round(run.wall_s, 3),
                       started_at=started.isoformat(timespec="seconds"), run_dir=str(run_dir.relative_to(results_dir)),
                       argv=launch.argv, threads=run.threads, gpus=run.gpus_env, **extra)


class Interrupted(KeyboardInterrupt):
    """The sweep was stopped by a signal (SIGINT, SIGTERM, SIGHUP); its runs were killed with it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT, SIGTERM (a scheduler's preemption, ``kill``) and SIGHUP unwind like Ctrl-C, so the
    running points are killed (SIGKILL needs no handler: the supervisors see the sweep's pipe close)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, _interrupt) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG, errno.EIO}


@contextlib.contextmanager
def disk_errors(results_dir: Path) -> Iterator[None]:
    """A results directory that cannot be written (read-only, full) is one error line, not a traceback."""
    try:
        yield
    except OSError as e:
        where = e.filename or results_dir
        if refused(e):
            raise RecipeError(f"{where}: {e.strerror}") from None
        what = "cannot write: " if e.errno in _DISK_ERRNOS else ""
        raise RecipeError(f"{where}: {what}{e.strerror or e}; the results recorded before are intact "
                          "(free space or fix permissions, then rerun to resume)") from None


def run_tasks(sweep: Sweep, results_dir: Path, runs: list[Task], show: Display, *, parallel: int = 1,
              gpus: list[str] | None = None, assign_gpus: bool = False, **extra) -> dict[str, SweepRecord]:
    """Run ``runs`` (in plan order, up to ``parallel`` at once), storing each record as it ends."""
    final: dict[str, SweepRecord] = {}
    queue = deque(runs)
    with _signals_interrupt(), Pool(parallel, gpus, assign_gpus) as pool:
        while queue or pool.runs:
            while queue and pool.fits(gpus_needed(sweep, queue[0].mode, queue[0].args)):
                task = queue.popleft()
                pool.start(prepare(task, sweep, results_dir), tag=(task, datetime.now(timezone.utc)))
                show.started(task.name)
            for run in pool.poll():
                task, started = run.tag
                rec = finish(task, sweep, results_dir, run, started, **extra)
                append_record(results_dir, rec)
                final[rec.key] = rec
                show.finished(task.name, rec)
            show.tick()
    return final


def _check_gpus(sweep: Sweep, runs: list[Task], gpus: list[str]) -> None:
    need = max((gpus_needed(sweep, t.mode, t.args) for t in runs), default=0)
    if gpus and need > len(gpus):
        raise RecipeError(f"a run needs {need} GPUs (nproc_per_node), but only {len(gpus)} are available to the "
                          f"sweep ({','.join(gpus)})")


def execute(sweep: Sweep, results_dir: Path, *, retry_failed: bool = False, modes: list[str] | None = None,
            parallel: int = 1, gpus: str | None = None, console=None) -> SweepSummary:
    """Run what the results store lacks (see :func:`to_run`), recording each run as it ends; the summary.

    ``parallel`` runs at once; with more than one (or with ``gpus``, e.g. ``"0,1,2,3"``), each run gets
    a disjoint slice of the visible GPUs as ``CUDA_VISIBLE_DEVICES``. The CPU cores are divided among
    the runs that run at once in either case.
    """
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(stderr=True)
    results_dir = Path(results_dir)
    if gpus is not None:
        parse_gpus(gpus)  # bad input fails before anything is written
    plan(sweep, results_dir)  # so does a sweep that cannot expand (two values, one recipe)
    with disk_errors(results_dir):
        results_dir.mkdir(parents=True, exist_ok=True)
    with results_lock(results_dir, what=f"scaletool sweep {sweep.name}"), disk_errors(results_dir):
        tasks, warnings = plan(sweep, results_dir)  # read under the lock: the truth for this sweep
        chosen = select(tasks, modes)
        for w in warnings:
            console.print(f"[yellow]warning:[/] {escape(w)}")
        write_meta(sweep, results_dir)
        todo = to_run(chosen, retry_failed)
        runs = [t for t in todo if t.state != "skipped"]
        assign = parallel > 1 or gpus is not None
        gpu_ids = visible_gpus(gpus) if assign else []
        _check_gpus(sweep, runs, gpu_ids)
        final: dict[str, SweepRecord] = {t.key: t.previous for t in chosen if t.previous is not None}
        with display(console, len(runs)) as show:
            for t in todo:
                if t.state == "skipped":
                    rec = skipped_record(t, sweep)
                    append_record(results_dir, rec)
                    final[rec.key] = rec
                    show.skipped(rec)
            final.update(run_tasks(sweep, results_dir, runs, show, parallel=max(1, min(parallel, len(runs))),
                                   gpus=gpu_ids, assign_gpus=assign))
    return summarize(sweep, results_dir, chosen, final, len(runs), parallel, warnings)


def summarize(sweep: Sweep, results_dir: Path, tasks: list[Task], final: dict[str, SweepRecord], ran_now: int,
              parallel: int, warnings: list[str]) -> SweepSummary:
    counts = {s: 0 for s in STATUSES}
    rows = []
    for t in tasks:
        rec = final.get(t.key)
        status = rec.status if rec else "pending"
        counts[status] = counts.get(status, 0) + 1
        rows.append(RunRow(key=t.key, label=t.point.label, mode=t.mode, repeat=t.repeat, status=status,
                           wall_s=rec.wall_s if rec else None, error=headline(rec) if rec else None))
    return SweepSummary(sweep=sweep.name, results_dir=str(results_dir), points=len({t.point.index for t in tasks}),
                        runs=len(tasks), ran_now=ran_now, parallel=parallel, status_counts=counts, warnings=warnings,
                        results=rows)


def execute_task(sweep: Sweep, results_dir: Path, n: int, digest: str, console=None) -> SweepRecord | None:
    """Run task ``n`` of the full plan alone (a Slurm array task), appending its record under the
    results file's lock; None when it is already recorded as done."""
    from rich.console import Console

    console = console or Console(stderr=True)
    results_dir = Path(results_dir)
    with results_lock(results_dir, shared=True), disk_errors(results_dir):
        tasks, _ = plan(sweep, results_dir)
        if plan_digest(tasks) != digest:
            raise RecipeError(f"{sweep.path}: the sweep's plan changed since it was submitted (plan {digest}, now "
                              f"{plan_digest(tasks)}); submit it again")
        if not 0 <= n < len(tasks):
            raise RecipeError(f"task {n}: the plan has tasks 0..{len(tasks) - 1}")
        task = tasks[n]
        if task.state == "done":
            console.print(f"{run_name(task.previous)}: already recorded as ok; nothing to do")
            return None
        job = os.environ.get("SLURM_ARRAY_JOB_ID")
        extra = {"slurm_job": f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID', n)}"} if job else {}
        with display(console, 0 if task.point.skipped else 1) as show:
            if task.point.skipped:
                rec = skipped_record(task, sweep).model_copy(update=extra)
                append_record(results_dir, rec)
                show.skipped(rec)
                return rec
            return run_tasks(sweep, results_dir, [task], show, **extra)[task.key]
