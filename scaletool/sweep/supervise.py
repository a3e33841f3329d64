"""The supervisor every sweep run goes through: nothing a point starts outlives it or the sweep.

``python -m scaletool.sweep.supervise --watch FD [--grace S] [--cpus LIST] -- COMMAND...``

A point may start processes outside its process group (torchrun's ranks), and a SIGKILLed sweep runs
no handler. The supervisor is a child subreaper (orphaned descendants stay in its tree); it holds the
read end of a pipe only the sweep writes, so the sweep's end (by any means) reads as EOF and kills the
tree; SIGTERM stops the point gracefully, then SIGKILL after ``--grace``; when the command exits,
left-over descendants are killed and its status (or fatal signal) is passed on. The direct child also
gets ``PR_SET_PDEATHSIG``. Standard library only, so it starts fast.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
KILL_WAIT_S = 10.0  # a process in uninterruptible sleep dies when it wakes; stop waiting for it after this

if sys.platform == "linux":
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)

    def _prctl(option: int, arg: int) -> int:
        return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)

    def subreaper(on: bool | None = None) -> bool:
        """Whether this process is a child subreaper; with ``on``, make it one (or not) and return the old value."""
        value = ctypes.c_int(0)
        _libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
        if on is not None:
            _prctl(_PR_SET_CHILD_SUBREAPER, int(on))
        return bool(value.value)

    def die_with_parent(sig: int = signal.SIGKILL) -> None:
        _prctl(_PR_SET_PDEATHSIG, sig)
else:  # no subreapers: orphans of a point escape to init (the point's own group is still killed)
    def subreaper(on: bool | None = None) -> bool:
        return False

    def die_with_parent(sig: int = signal.SIGKILL) -> None:
        return None


def process_table() -> dict[int, tuple[int, str]]:
    """``{pid: (ppid, state)}`` of every process visible here (``/proc``; ``ps`` where there is none)."""
    table: dict[int, tuple[int, str]] = {}
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
            fields = stat[stat.rfind(b")") + 2:].split()
            table[int(name)] = (int(fields[1]), fields[0].decode())
        return table
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), parts[2][:1])
    return table


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """Every descendant of ``root`` (children first), zombies included."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def carries(pid: int, marker: bytes) -> bool:
    """Whether ``pid``'s environment holds the ``NAME=value`` entry ``marker``."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap(status: dict[int, int], keep: int) -> bool:
    """Collect every exited child without blocking (orphans included), recording the status of
    ``keep`` in ``status``; False once this process has no children left."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == keep:
            status[pid] = st


def kill_tree(status: dict[int, int], keep: int) -> None:
    """SIGKILL every descendant of this process until none is left (orphans come back to a subreaper)."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        table = process_table()
        live = [p for p in descendants(os.getpid(), table) if table[p][1] != "Z"]
        signal_all(live, signal.SIGKILL)
        if not reap(status, keep) and not live:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _spawn(cmd: list[str]) -> int:
    """Fork and exec ``cmd`` in a new session; it dies with this process (PDEATHSIG)."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: only async-signal-safe work until exec (this process has no threads)
        os.setsid()
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:  # the supervisor died before PDEATHSIG was armed
            os._exit(137)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):  # ignored dispositions survive exec
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.execvp(cmd[0], cmd)
    except BaseException as e:  # noqa: BLE001 (report any failure to start, then leave without cleanup)
        os.write(2, f"scaletool sweep: cannot start {cmd[0]}: {e}\n".encode(errors="replace"))
    os._exit(127)


def _exit_like(st: int) -> None:
    """Exit with the child's status; re-raise its fatal signal (without a core file) so our parent sees it."""
    code = os.waitstatus_to_exitcode(st)
    if code < 0:
        import resource

        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those have no disposition to reset
            signal.signal(-code, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def supervise(cmd: list[str], watch_fd: int, grace_s: float, cpus: set[int] | None = None) -> None:
    """Run ``cmd`` under supervision (see the module docstring); never returns."""
    subreaper(True)
    os.set_inheritable(watch_fd, False)
    if cpus:
        os.sched_setaffinity(0, cpus)  # inherited by the command and all it starts
    stop: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD and SIGTERM wake the select below at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the sweep decides what a Ctrl-C stops
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    signal.signal(signal.SIGCHLD, lambda s, f: None)
    child = _spawn(cmd)
    status: dict[int, int] = {}
    term_at = None
    while child not in status:
        ready, _, _ = select.select([watch_fd, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 512)
        if watch_fd in ready and not os.read(watch_fd, 512):  # EOF: the sweep is gone
            kill_tree(status, child)
            os._exit(128 + signal.SIGKILL)
        if stop and term_at is None:
            term_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child, signal.SIGTERM)
        if term_at is not None and time.monotonic() - term_at > grace_s:
            kill_tree(status, child)
        reap(status, child)
    kill_tree(status, child)  # stragglers: ranks a launcher left behind, daemons of the point
    _exit_like(status[child])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scaletool.sweep.supervise", description=__doc__.splitlines()[0])
    p.add_argument("--watch", type=int, required=True, help="read end of the sweep's pipe; EOF kills everything")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on a stop")
    p.add_argument("--cpus", default="", help="comma-separated CPU numbers to pin the command to")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given")
    cpus = {int(c) for c in args.cpus.split(",") if c.strip()} or None
    supervise(cmd, args.watch, args.grace, cpus)


if __name__ == "__main__":
    main()
