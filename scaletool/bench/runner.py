"""Run a study: each command as an argument list in its own process group, resumable, and recorded.

Every attempt appends one line to ``OUT/runs.jsonl``: the study, the command (as written and as run), its
result file, status, exit status, start time and wall time, and the environment it ran in (date, cards,
driver, torch, CUDA, Python, the repository's commit). A command whose result file exists is skipped, so
rerunning a study resumes it; a command whose stdout is its result writes that file only when it succeeds.

A result names the commit it ran, so it can be regenerated from that commit: the runner refuses a tree that
differs from its commit (tracked edits or untracked files), unless ``allow_dirty``, which writes the
difference (``git diff``, untracked files included) beside the runs as ``tree-SHA.diff`` and names it in
each record. Inside ``OUT`` the runner writes only regular files and directories it made: a symbolic link,
FIFO or device at ``runs.jsonl``, ``logs``, a ``.partial`` file, a result's folder or an input's destination
is refused (one error line) before anything runs through it.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scaletool import records
from scaletool.bench.study import ROOT, Command, Study, StudyError
from scaletool.errors import echo
from scaletool.fmt import open_state, refuse_link

RUNS_FILE = "runs.jsonl"
_KILL_GRACE_S = 10.0


@dataclass(frozen=True)
class Planned:
    command: Command
    argv: tuple[str, ...]  # as run: the program resolved, {out} substituted
    result: Path
    done: bool


def resolve_argv(c: Command, out: Path) -> tuple[str, ...]:
    argv = [a.replace("{out}", str(out)) for a in c.argv]
    head = {"scaletool": [sys.executable, "-m", "scaletool"], "python": [sys.executable],
            "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[argv[0]]
    return tuple(head + argv[1:])


def plan(study: Study, out: Path, only: list[str] | None = None) -> list[Planned]:
    commands = list(study.commands)
    if only:
        import fnmatch
        unmatched = [p for p in only if not any(fnmatch.fnmatchcase(c.name, p) for c in commands)]
        if unmatched:
            raise StudyError([f"--only {p!r:.60} matches no command of study {study.name}" for p in unmatched])
        commands = [c for c in commands if any(fnmatch.fnmatchcase(c.name, p) for p in only)]
    out = out.resolve()
    return [Planned(c, resolve_argv(c, out), out / c.result, _done(out / c.result)) for c in commands]


def _done(result: Path) -> bool:
    """A result is there: a folder, a non-empty file, or a file already packed into the run folder's bundle."""
    try:
        return result.is_dir() or result.stat().st_size > 0
    except OSError:
        return records.exists(result)


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def environment() -> dict:
    """Where a result was measured: date, cards, driver, torch, CUDA, Python, the repository's commit."""
    env: dict = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        cuda = torch.cuda.is_available()
        env["cards"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    except ImportError:
        env.update(torch=None, cuda=None, cards=[])
    env["cpu"] = _cpu_model()
    env["driver"] = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return env


def _git(repo: Path, *args: str, ok=(0,)) -> bytes | None:
    """git's stdout in ``repo`` (None: no git, not a checkout, or an exit status outside ``ok``)."""
    if shutil.which("git") is None:
        return None
    try:
        p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=60, check=False,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode in ok else None


def provenance(out: Path, allow_dirty: bool, repo: Path = ROOT) -> dict:
    """The commit the runs come from, checked before anything runs: a tree that differs from it (tracked
    edits, untracked files git does not ignore) is refused, or with ``allow_dirty`` its difference is written
    to ``OUT/tree-SHA.diff`` (untracked files as additions) and named here. Raises StudyError."""
    head = _git(repo, "rev-parse", "--verify", "HEAD")
    if head is None:
        if not allow_dirty:
            raise StudyError([f"{repo}: not a git checkout, so the results could not name the commit they ran; run "
                              "from a checkout, or pass --allow-dirty to record them without one"])
        return {"commit": None, "tree_differs_from_commit": None}
    commit = head.decode().strip()
    listing = _git(repo, "status", "--porcelain", "-z", "--untracked-files=all") or b""
    entries = [e for e in listing.decode("utf-8", "replace").split("\0") if e]
    if not entries:
        return {"commit": commit, "tree_differs_from_commit": False}
    if not allow_dirty:
        first = entries[0][3:]
        raise StudyError([f"the tree differs from its commit {commit[:12]} ({len(entries)} path(s), first "
                          f"{echo(first)}); commit it, or pass --allow-dirty to record the difference beside the runs"])
    diff = _git(repo, "diff", "--binary", "HEAD") or b""
    untracked = _git(repo, "ls-files", "-z", "--others", "--exclude-standard") or b""
    for name in filter(None, untracked.decode("utf-8", "replace").split("\0")):
        diff += _git(repo, "diff", "--binary", "--no-index", "--", "/dev/null", name, ok=(0, 1)) or b""
    sha = hashlib.sha256(diff).hexdigest()
    name = f"tree-{sha[:12]}.diff"
    with os.fdopen(open_state(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(diff)
    return {"commit": commit, "tree_differs_from_commit": True, "tree_diff": name, "tree_diff_sha256": sha}


def _inside(out: Path, rel: Path) -> Path:
    """``out/rel`` as a directory the runner may write in: each part made if missing, none a symbolic link
    (OSError: refused). ``out`` itself is the user's to name."""
    here = out
    for part in rel.parts:
        here = here / part
        refuse_link(here)
        here.mkdir(exist_ok=True)
    return here


def _open_out(path: Path, append: bool = False):
    """A file the runner keeps inside ``OUT``, opened for writing: never through a link, never a FIFO."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    return os.fdopen(open_state(path, flags), "ab" if append else "wb")


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _run_quiet(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = sorted(set(p.stdout.split())) if p.returncode == 0 else []
    return " ".join(lines) or None


def run_study(study: Study, out: Path, only: list[str] | None = None, log=print, deadline_s: float | None = None,
              allow_dirty: bool = False, repo: Path = ROOT) -> int:
    """Run the study's missing commands in order; 0 when every command has its result, else 1.

    ``deadline_s``: no command starts after that many seconds, and one still running then is stopped
    (recorded as ``deadline``); what did not run stays to do, so rerunning into ``out`` resumes.
    ``allow_dirty``: run from a tree that differs from its commit, the difference recorded (:func:`provenance`);
    ``repo``: the checkout whose commit the records name. Raises StudyError (nothing run) or OSError (a
    link or FIFO where the runner writes).
    """
    planned = plan(study, out, only)
    t_start = time.monotonic()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    _inside(out, Path("logs"))
    _open_out(out / RUNS_FILE, append=True).close()  # a link planted there is refused before anything runs
    env_record = None
    if not all(p.done for p in planned):
        env_record = {**environment(), **provenance(out, allow_dirty, repo)}
    failed = 0
    for i, p in enumerate(planned, 1):
        tag = f"[{i}/{len(planned)}] {p.command.name}"
        if p.done:
            log(f"{tag}: skipped, its result exists ({p.command.result})")
            continue
        left = None if deadline_s is None else deadline_s - (time.monotonic() - t_start)
        if left is not None and left <= 0:
            log(f"{tag}: not started, the deadline ({deadline_s:g} s) has passed; rerun to resume")
            failed += 1
            continue
        record = _run_one(study, p, out, env_record, left)
        log(f"{tag}: {record['status']} after {record['wall_s']:.1f} s"
            + (f" (exit status {record['returncode']}; see logs/{p.command.name}.stderr)" if record["status"] != "ok" else ""))
        failed += record["status"] != "ok"
    return 1 if failed else 0


def _run_one(study: Study, p: Planned, out: Path, env_record: dict, left_s: float | None = None) -> dict:
    c = p.command
    timeout, status_on_timeout = c.timeout_s, "timeout"
    if left_s is not None and (timeout is None or left_s < timeout):
        timeout, status_on_timeout = left_s, "deadline"
    for src, dst in c.inputs:  # never over a link's target: a planted link is refused, not followed
        target = _inside(out, Path(dst).parent) / Path(dst).name
        if (ROOT / src).exists():
            with open(ROOT / src, "rb") as source, _open_out(target) as copy:
                shutil.copyfileobj(source, copy)
        else:  # a committed record packed into its run folder's bundle
            with _open_out(target) as copy:
                copy.write(records.read_record(ROOT / src).encode("utf-8"))
    _inside(out, Path(c.result).parent)
    logs = _inside(out, Path("logs"))
    partial = p.result.with_name(p.result.name + ".partial") if c.stdout else logs / f"{c.name}.stdout"
    env = {**os.environ, **c.env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    with _open_out(partial) as stdout, _open_out(logs / f"{c.name}.stderr") as stderr:
        proc = subprocess.Popen(p.argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env,
                                cwd=out if c.cwd == "out" else ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else "failed"
            _reap_group(proc)  # what the command left running in its group ends with it
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = proc.returncode, status_on_timeout
        except BaseException:  # Ctrl-C or SIGTERM to the runner: nothing it started outlives it
            _kill_group(proc)
            raise
    wall = time.monotonic() - t0
    if status == "ok" and c.stdout:
        os.replace(partial, p.result)
    if status == "ok" and not _done(p.result):
        status = "no result"
    record = {"study": study.name, "command": c.name, "argv": list(c.argv), "argv_run": list(p.argv),
              "env": c.env, "cwd": c.cwd, "result": c.result, "status": status, "returncode": rc,
              "started_utc": started, "wall_s": round(wall, 3), "environment": env_record}
    with _open_out(out / RUNS_FILE, append=True) as f:
        f.write((json.dumps(record, sort_keys=True) + "\n").encode())
    return record


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group, SIGKILL to whatever is left after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=_KILL_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _reap_group(proc)


def _reap_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
