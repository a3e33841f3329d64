"""Running a sweep's processes: up to N at once, each on its own share of CPU cores and GPUs, each
under a :mod:`~scaletool.sweep.supervise` supervisor, with timeouts and kill semantics.

- :func:`plan_slots` divides the sweep's cores among the runs that run at once (one run: all of them)
  and, with ``--parallel``, pins each slot to its own cores; :func:`visible_gpus` lists the GPUs a
  parallel sweep hands out as ``CUDA_VISIBLE_DEVICES`` slices.
- :class:`Pool` starts supervised runs, enforces each run's timeout (SIGTERM, then SIGKILL after a
  grace period, through the supervisor) and, on any interruption, takes every run down with it.

The sweep process is a child subreaper while a pool is open, as a backstop: should a supervisor itself
be killed, the processes it supervised re-parent to the sweep, which recognises them by the marker in
their environment and kills them.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scaletool import threads
from scaletool.errors import RecipeError
from scaletool.sweep import supervise

TERM_GRACE_S = 10.0  # between SIGTERM and SIGKILL on timeout: lets a launcher stop its workers
POLL_S = 0.2
SUPERVISOR_EXIT_S = 15.0  # how long an interrupted sweep waits for its supervisors to clean up
#: the environment variable that marks every process of a sweep's runs (value: the pool's token)
MARKER_ENV = "SCALETOOL_SWEEP_TOKEN"


@dataclass(frozen=True)
class Slot:
    """A share of the machine for one run at a time: cores to pin to (None: inherit) and their count."""

    index: int
    cores: int
    cpus: tuple[int, ...] | None = None


def plan_slots(parallel: int) -> list[Slot]:
    """``parallel`` slots over this process's CPU share; pinned to disjoint cores when there are enough."""
    share = threads.cpu_share()
    per = max(1, share // parallel)
    try:
        mask = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mask = []
    if parallel == 1 or len(mask) < per * parallel:
        return [Slot(i, per) for i in range(parallel)]
    return [Slot(i, per, tuple(mask[i * per:(i + 1) * per])) for i in range(parallel)]


_GPU_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_-]*")


def parse_gpus(text: str) -> list[str]:
    """``0,1,2,3`` (or GPU UUIDs) -> ids; a malformed list is one RecipeError line."""
    ids = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in ids if not _GPU_ID.fullmatch(g)]
    if bad or not ids or len(set(ids)) != len(ids):
        raise RecipeError(f"GPU list {text[:80]!r}: expected distinct comma-separated GPU indices or UUIDs, e.g. 0,1,2,3")
    return ids


def visible_gpus(explicit: str | None = None) -> list[str]:
    """GPUs this sweep may hand out: ``--gpus``, else ``CUDA_VISIBLE_DEVICES``, else what nvidia-smi lists
    (no torch import: a sweep process stays light)."""
    if explicit is not None:
        return parse_gpus(explicit)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and not g.strip().startswith("-")]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()] if out.returncode == 0 else []


@dataclass
class Launch:
    """One process to run: its command, logs, time limit and resource needs."""

    argv: list[str]
    stdout: Path
    stderr: Path
    timeout_s: float
    ranks: int = 1  # processes the command starts on this node (train --nproc-per-node)
    gpus_needed: int = 0


@dataclass
class Run:
    """A started launch: its supervisor, the pipe that keeps the supervisor alive, and its clock."""

    launch: Launch
    proc: subprocess.Popen
    pipe_w: int | None
    slot: Slot
    gpus: list[str]
    threads: int
    t0: float
    term_at: float | None = None
    timed_out: bool = False
    returncode: int | None = None
    wall_s: float = 0.0
    tag: object = None

    @property
    def gpus_env(self) -> str | None:
        return ",".join(self.gpus) if self.gpus else None


class Pool:
    """At most ``parallel`` supervised runs at once, each in a free slot with the GPUs it needs."""

    def __init__(self, parallel: int = 1, gpus: list[str] | None = None, assign_gpus: bool = False):
        self.slots = plan_slots(parallel)
        self.free_slots = list(self.slots)
        self.gpus = list(gpus or [])
        self.free_gpus = list(self.gpus)
        self.assign_gpus = assign_gpus
        self.runs: list[Run] = []
        self.token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._was_subreaper: bool | None = None

    def __enter__(self) -> Pool:
        self._was_subreaper = supervise.subreaper(True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.runs:  # interrupted (or failed) with runs in flight: nothing of theirs may survive
                self.kill_all()
        finally:
            supervise.subreaper(bool(self._was_subreaper))

    # -- placing and starting ---------------------------------------------------------------------

    def fits(self, gpus_needed: int) -> bool:
        """Whether a run needing ``gpus_needed`` GPUs can start now: a free slot, and its GPUs free
        when GPUs are handed out."""
        if not self.free_slots:
            return False
        return not (self.assign_gpus and self.gpus) or len(self.free_gpus) >= gpus_needed

    def start(self, launch: Launch, tag: object = None) -> Run:
        slot = self.free_slots.pop(0)
        gpus: list[str] = []
        if self.assign_gpus and self.gpus and launch.gpus_needed:
            gpus, self.free_gpus = self.free_gpus[:launch.gpus_needed], self.free_gpus[launch.gpus_needed:]
        env, n_threads = thread_env(slot.cores, launch.ranks)
        env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", MARKER_ENV: self.token}
        if self.assign_gpus and self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # none for a run that needs none
        pipe_r, pipe_w = os.pipe()
        argv = [sys.executable, "-m", "scaletool.sweep.supervise", "--watch", str(pipe_r),
                "--grace", repr(TERM_GRACE_S)]
        if slot.cpus:
            argv += ["--cpus", ",".join(map(str, slot.cpus))]
        try:
            with open(launch.stdout, "wb") as out, open(launch.stderr, "wb") as err:
                proc = subprocess.Popen([*argv, "--", *launch.argv], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                        env=env, pass_fds=(pipe_r,), start_new_session=True)
        except BaseException:
            os.close(pipe_w)
            self._release(slot, gpus)
            raise
        finally:
            os.close(pipe_r)
        run = Run(launch, proc, pipe_w, slot, gpus, n_threads, time.monotonic(), tag=tag)
        self.runs.append(run)
        return run

    def _release(self, slot: Slot, gpus: list[str]) -> None:
        self.free_slots.append(slot)
        self.free_slots.sort(key=lambda s: s.index)
        self.free_gpus = [g for g in self.gpus if g in self.free_gpus or g in gpus]

    # -- waiting ----------------------------------------------------------------------------------

    def poll(self) -> list[Run]:
        """Runs that ended since the last call (timeouts enforced on the way); sleeps a little if none did."""
        done = []
        now = time.monotonic()
        for run in list(self.runs):
            rc = run.proc.poll()
            if rc is None:
                self._enforce_timeout(run, now)
                continue
            run.returncode, run.wall_s = rc, now - run.t0
            self._close(run)
            self.runs.remove(run)
            self._release(run.slot, run.gpus)
            done.append(run)
        if done:
            self._kill_strays()
        else:
            time.sleep(POLL_S)
        return done

    def _enforce_timeout(self, run: Run, now: float) -> None:
        if run.term_at is None and now - run.t0 > run.launch.timeout_s:
            run.timed_out, run.term_at = True, now
            with contextlib.suppress(ProcessLookupError):
                run.proc.send_signal(signal.SIGTERM)  # the supervisor stops the point: TERM, grace, KILL
        elif run.term_at is not None and now - run.term_at > TERM_GRACE_S + SUPERVISOR_EXIT_S:
            with contextlib.suppress(ProcessLookupError):
                run.proc.kill()  # a supervisor that does not finish: its orphans come to us (_kill_strays)

    @staticmethod
    def _close(run: Run) -> None:
        if run.pipe_w is not None:
            os.close(run.pipe_w)
            run.pipe_w = None

    # -- stopping ---------------------------------------------------------------------------------

    def kill_all(self) -> None:
        """Stop every run now: closing a run's pipe makes its supervisor SIGKILL the run's whole tree."""
        for run in self.runs:
            self._close(run)
        deadline = time.monotonic() + SUPERVISOR_EXIT_S
        for run in self.runs:
            try:
                run.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                run.proc.kill()
                run.proc.wait()
        self.runs.clear()
        self._kill_strays()

    def _kill_strays(self) -> None:
        """SIGKILL processes of our runs that re-parented to this process (their supervisor was killed),
        and reap the ones that already exited."""
        marker = f"{MARKER_ENV}={self.token}".encode()
        mine = {run.proc.pid for run in self.runs}
        me = os.getpid()
        for _ in range(100):
            table = supervise.process_table()
            orphans = [p for p, (ppid, state) in table.items()
                       if ppid == me and state != "Z" and p not in mine and supervise.carries(p, marker)]
            strays = orphans + [d for p in orphans for d in supervise.descendants(p, table) if table[d][1] != "Z"]
            supervise.signal_all(strays, signal.SIGKILL)
            self._reap_strays(mine)
            if not strays:
                return
            time.sleep(0.01)

    @staticmethod
    def _reap_strays(mine: set[int]) -> None:
        """Reap exited children that are not our supervisors (``subprocess`` reaps those itself)."""
        if not hasattr(os, "waitid"):
            return
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in mine:
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.si_pid, 0)


def thread_env(cores: int, ranks: int) -> tuple[dict[str, str], int]:
    """Environment giving a run ``cores`` cores shared by its ``ranks`` processes; the threads each gets.

    ``SCALETOOL_CPU_THREADS`` is the run's share (a launcher inside divides it among its ranks); the
    OpenMP/MKL pools get the per-process count. An ``OMP_NUM_THREADS`` set by the user wins (the rule
    of :func:`scaletool.threads.threads_per_process`).
    """
    n = threads.threads_per_process(ranks, {**os.environ, threads.SHARE_ENV: str(cores)})
    env = threads.child_env(cores)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(n)
    return env, n
