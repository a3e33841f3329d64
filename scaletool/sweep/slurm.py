"""A sweep as a Slurm job array: one array task per pending (point, mode, repeat).

Slurm is the scheduler; scaletool does not place work across nodes itself. The array index of a task
is the run's position in the sweep's full plan (:func:`~scaletool.sweep.runner.plan`), so the script
needs no task list: each task runs ``python -m scaletool sweep SWEEP -o DIR --only-task
$SLURM_ARRAY_TASK_ID --plan-digest D``, which re-reads the sweep, checks that its plan is still the one
submitted (``D``), runs that one run under the results directory's shared lock and appends its record
to ``results.jsonl`` under the file's own lock.

Every submission is logged in ``DIR/slurm/submissions.jsonl`` (job id, array index -> run key). A
rerun submits only runs that are neither recorded (ok; failed ones too with ``--retry-failed``) nor
still queued or running in an earlier submission (asked of ``squeue``), so no run is submitted twice.
"""
from __future__ import annotations

import getpass
import json
import math
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from scaletool.errors import RecipeError
from scaletool.fmt import open_state, write_atomic
from scaletool.launch.slurm import Shell, SlurmOptions, render_array, submit
from scaletool.results.sweep import SweepSubmission
from scaletool.sweep.lock import results_lock
from scaletool.sweep.runner import (
    Task,
    disk_errors,
    gpus_needed,
    plan,
    plan_digest,
    select,
    skipped_record,
    to_run,
)
from scaletool.sweep.spec import Sweep, slug
from scaletool.sweep.store import append_record

SLURM_DIR = "slurm"
SUBMISSIONS = "submissions.jsonl"
SLACK_S = 600  # added to the longest run timeout for the array tasks' --time: start-up, result writing


def array_spec(indices: list[int], throttle: int | None = None) -> str:
    """Slurm's ``--array`` value for ``indices``: runs of consecutive indices as ranges (``0-2,5,7-8``),
    ``%N`` to run at most N tasks at once."""
    idx = sorted(set(indices))
    if not idx:
        raise ValueError("an array needs at least one index")
    parts = []
    start = prev = idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts) + (f"%{throttle}" if throttle else "")


def _submissions(results_dir: Path) -> list[dict]:
    path = results_dir / SLURM_DIR / SUBMISSIONS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("job_id"), str) and isinstance(rec.get("tasks"), dict):
            out.append(rec)
    return out


_TASK_ID = re.compile(r"(\d+)_(\d+)")
_TASK_RANGE = re.compile(r"(\d+)_\[([0-9,\-]+)(?:%\d+)?\]")


def queued_tasks() -> set[tuple[str, int]] | None:
    """(job id, array index) of this user's array tasks still queued or running; None without squeue."""
    if shutil.which("squeue") is None:
        return None
    res = subprocess.run(["squeue", "--noheader", "--array", "--format=%i", f"--user={getpass.getuser()}"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RecipeError(f"squeue failed: {(res.stderr.strip().splitlines() or [f'exit status {res.returncode}'])[-1]}")
    live: set[tuple[str, int]] = set()
    for word in res.stdout.split():
        if m := _TASK_ID.fullmatch(word):
            live.add((m.group(1), int(m.group(2))))
        elif m := _TASK_RANGE.fullmatch(word):  # a pending range squeue did not expand
            for part in m.group(2).split(","):
                lo, _, hi = part.partition("-")
                live.update((m.group(1), i) for i in range(int(lo), int(hi or lo) + 1))
    return live


def live_keys(results_dir: Path) -> tuple[set[str], list[str]]:
    """Keys of runs an earlier submission still has queued or running; warnings."""
    subs = _submissions(results_dir)
    if not subs:
        return set(), []
    live = queued_tasks()
    if live is None:
        return set(), ["squeue: not found on PATH; cannot tell which runs of earlier submissions are still queued, "
                       "so they may be submitted again"]
    keys = {key for s in subs for idx, key in s["tasks"].items() if (s["job_id"], int(idx)) in live}
    return keys, []


def _minutes(seconds: float) -> str:
    return str(max(1, math.ceil(seconds / 60)))


def submit_sweep(sweep: Sweep, results_dir: Path, *, overrides: list[str], modes: list[str] | None,
                 retry_failed: bool, opts: SlurmOptions, throttle: int | None = None,
                 dry_run: bool = False) -> SweepSubmission | None:
    """Submit the sweep's missing runs as a job array (or, ``dry_run``, return the script as text).

    None when nothing is left to submit. ``opts.time`` None: the longest run timeout plus slack;
    ``opts.gpus_per_node`` None: the most GPUs any submitted run needs.
    """
    results_dir = Path(results_dir).resolve()
    if dry_run:
        return _submission(sweep, results_dir, overrides, modes, retry_failed, opts, throttle)
    slurm_dir = results_dir / SLURM_DIR
    with disk_errors(results_dir):
        slurm_dir.mkdir(parents=True, exist_ok=True)  # also where Slurm opens the tasks' logs
    # No local sweep may be running here (it holds the directory exclusively); array tasks of an
    # earlier submission may (they hold it shared). Submitters take turns on the slurm/ lock, and
    # decide what is missing under it.
    with results_lock(results_dir, shared=True), results_lock(slurm_dir, what=f"scaletool sweep --submit {sweep.name}"), \
            disk_errors(results_dir):
        tasks, _ = plan(sweep, results_dir)
        for t in to_run(select(tasks, modes), retry_failed):
            if t.state == "skipped":
                append_record(results_dir, skipped_record(t, sweep))
        sub = _submission(sweep, results_dir, overrides, modes, retry_failed, opts, throttle)
        if sub is None:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        path = slurm_dir / f"{slug(sweep.name) or 'sweep'}-{stamp}.sbatch"
        write_atomic(path, sub.script)
        job_id = submit(path)
        entry = {"job_id": job_id, "submitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "script": str(path), "tasks": dict(zip(map(str, sub.tasks), sub.keys))}
        with open(open_state(slurm_dir / SUBMISSIONS, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
    return sub.model_copy(update={"job_id": job_id, "script": str(path)})


def _submission(sweep: Sweep, results_dir: Path, overrides: list[str], modes: list[str] | None, retry_failed: bool,
                opts: SlurmOptions, throttle: int | None) -> SweepSubmission | None:
    """What to submit now (script as text), or None when every run is recorded or still queued."""
    tasks, warnings = plan(sweep, results_dir)
    live, more = live_keys(results_dir)
    chosen = select(tasks, modes)
    # points that do not validate need no job: the submitter records them (see submit_sweep)
    todo = [t for t in to_run(chosen, retry_failed) if t.key not in live and t.state != "skipped"]
    if not todo:
        return None
    script = render_script(sweep, results_dir, todo, plan_digest(tasks), overrides, opts, throttle)
    return SweepSubmission(sweep=sweep.name, results_dir=str(results_dir), script=script, tasks=[t.n for t in todo],
                           keys=[t.key for t in todo], skipped_live=sum(t.key in live for t in chosen),
                           warnings=warnings + more)


def render_script(sweep: Sweep, results_dir: Path, todo: list[Task], digest: str, overrides: list[str],
                  opts: SlurmOptions, throttle: int | None) -> str:
    """The array script for ``todo`` (every path absolute: the job may start anywhere)."""
    command = [sys.executable, "-m", "scaletool", "sweep", str(sweep.path.resolve()), "--out", str(results_dir)]
    for o in overrides:
        command += ["--set", o]
    command += ["--only-task", Shell("${SLURM_ARRAY_TASK_ID}"), "--plan-digest", digest]
    time_s = max(sweep.timeout(t.mode) for t in todo) + SLACK_S
    gpus = max(gpus_needed(sweep, t.mode, t.args) for t in todo)
    opts = SlurmOptions(
        time=opts.time or _minutes(time_s), partition=opts.partition, account=opts.account,
        job_name=opts.job_name or f"scaletool-sweep-{slug(sweep.name) or 'sweep'}",
        gpus_per_node=gpus if opts.gpus_per_node is None else opts.gpus_per_node, cpus_per_task=opts.cpus_per_task,
        exports=opts.exports, workdir=str(Path(opts.workdir).resolve()),
        output=opts.output or str(results_dir / SLURM_DIR / "%A_%a.out"))
    return render_array(command, array=array_spec([t.n for t in todo], throttle), opts=opts)
