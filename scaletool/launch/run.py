"""Running a built launch command and saying how it ended.

torchrun runs in this process: the argument list from :func:`~scaletool.launch.commands.torchrun_argv`
goes through torchrun's own parser (``torch.distributed.run.parse_args``, so ``--dry-run`` shows
exactly what runs) into its ``run``, and this process becomes the node's elastic agent. That way the
agent's failures arrive as exceptions with per-rank detail (``ChildFailedError.failures``,
rendezvous errors) instead of a traceback to scrape. The DeepSpeed launcher runs as a subprocess.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

from scaletool.fmt import stdout_to_stderr
from scaletool.launch.commands import TORCHRUN, LaunchSpec
from scaletool.launch.failures import child_failure_lines, rendezvous_failure_line


@dataclass
class Outcome:
    exit_code: int
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# What torch's C++ side writes to stderr around a store that cannot be reached: its c10d log lines
# ("[W1127 19:06:28.29 TCPStore.cpp:340] [c10d] ... retrying") and the stack frames of the C++
# exception ("Exception raised from ...", "frame #0: ..."). The line scaletool prints says what happened.
_CPP_NOISE = re.compile(rb"^(?:frame #\d+: |Exception raised from |<omitting python frames>|"
                        rb"\[[IWE]\d{4} [0-9:.]+ \S+\.cpp:\d+\] \[c10d\] )")


@contextlib.contextmanager
def cpp_noise_filtered():
    """Pass this process's stderr (file descriptor 2, which C++ writes to directly, and every child inherits)
    through a filter that drops :data:`_CPP_NOISE` lines; everything else arrives as written."""
    import threading

    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except OSError:  # no descriptors left: leave stderr as it is
        yield
        return
    os.dup2(write_end, 2)
    os.close(write_end)

    def keep(line: bytes, state: list[bool]) -> bool:
        """Not noise, nor the blank line that ends a dropped C++ exception's frames."""
        noise = bool(_CPP_NOISE.match(line)) or (state[0] and not line.strip())
        state[0] = noise
        return not noise

    def forward(data: bytes) -> None:
        try:
            os.write(saved, data)
        except OSError:  # stderr itself gone (closed, a full disk): drop it, but keep draining the pipe, or
            pass  # the workers writing to it would block once it fills

    def pump() -> None:
        pending, state = b"", [False]
        with os.fdopen(read_end, "rb", buffering=0) as src:
            while chunk := src.read(1 << 16):  # b"" once every writer (this process, its children) closed it
                *lines, pending = (pending + chunk).split(b"\n")
                kept = b"".join(line + b"\n" for line in lines if keep(line, state))
                if kept:
                    forward(kept)
                if len(pending) > 1 << 20:  # a megabyte without a newline: pass it on as it is
                    forward(pending)
                    pending = b""
        if pending and keep(pending, state):
            forward(pending)

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes this process's write end; the pump ends when the children's are closed too
        thread.join(timeout=10)
        if not thread.is_alive():
            os.close(saved)


def run_torchrun(argv: list[str], env: dict[str, str], spec: LaunchSpec, quiet_stdout: bool = False) -> Outcome:
    """Be this node's torchrun agent for ``argv`` (``python -m torch.distributed.run ARGS``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    if argv[1:3] != ["-m", TORCHRUN]:
        raise ValueError(f"not a torchrun command: {argv[:3]}")
    args = parse_args(argv[3:])
    endpoint = spec.rdzv_endpoint or "localhost (standalone)"
    with _environ(env), stdout_to_stderr(quiet_stdout), cpp_noise_filtered():
        try:
            run(args)
        except ChildFailedError as e:
            return Outcome(1, child_failure_lines(e))
        except RendezvousError as e:
            return Outcome(1, [rendezvous_failure_line(e, endpoint, args.rdzv_id, spec.nnodes, spec.rdzv_timeout_s)])
        except SignalException as e:
            return Outcome(128 + int(e.sigval), [f"error: stopped by {e.sigval.name}; workers were shut down"])
    return Outcome(0)


def run_subprocess(argv: list[str], env: dict[str, str], what: str, quiet_stdout: bool = False) -> Outcome:
    """Run a launcher (the DeepSpeed runner) as a child; its ranks print their own error lines."""
    res = subprocess.run(argv, env={**os.environ, **env}, stdout=sys.stderr if quiet_stdout else None)
    if res.returncode == 0:
        return Outcome(0)
    how = f"killed by signal {-res.returncode}" if res.returncode < 0 else f"exit status {res.returncode}"
    return Outcome(res.returncode if res.returncode > 0 else 1,
                   [f"error: {what} failed ({how}); the failing ranks' error lines are above"])
