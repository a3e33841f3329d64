"""Run a study: each command as an argument list in its own process group, resumable, and recorded.

Every attempt appends one line to ``OUT/runs.jsonl``: the study, the command (as written and as run), its
result file, status, exit status, start time and wall time, and the environment it ran in (date, cards,
driver, torch, CUDA, Python, the repository's commit). A command whose result file exists is skipped, so
rerunning a study resumes it; a command whose stdout is its result writes that file only when it succeeds.
"""
from __future__ import annotations

import datetime as dt
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

from scaletool.bench.study import ROOT, Command, Study, StudyError

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
    try:
        return result.is_dir() or result.stat().st_size > 0
    except OSError:
        return False


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
    env["commit"] = _run_quiet(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    # a tree that differs from that commit (uncommitted edits, or a copied tree whose .git is older)
    status = _run_quiet(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    env["tree_differs_from_commit"] = None if env["commit"] is None else bool(status)
    return env


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


def run_study(study: Study, out: Path, only: list[str] | None = None, log=print, deadline_s: float | None = None) -> int:
    """Run the study's missing commands in order; 0 when every command has its result, else 1.

    ``deadline_s``: no command starts after that many seconds, and one still running then is stopped
    (recorded as ``deadline``); what did not run stays to do, so rerunning into ``out`` resumes.
    """
    planned = plan(study, out, only)
    t_start = time.monotonic()
    out = out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env_record = None
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
        if env_record is None:
            env_record = environment()
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
    for src, dst in c.inputs:
        target = out / dst
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / src, target)
    p.result.parent.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    partial = p.result.with_name(p.result.name + ".partial") if c.stdout else logs / f"{c.name}.stdout"
    env = {**os.environ, **c.env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    with open(partial, "wb") as stdout, open(logs / f"{c.name}.stderr", "wb") as stderr:
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
    with open(out / RUNS_FILE, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
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
