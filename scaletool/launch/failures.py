"""Failures of launched ranks, as one line naming the rank and the cause.

Two sides:

- In a worker, :func:`reported_failures` wraps the rank's work. An exception becomes
  ``error: rank 1/2 (node 1, local rank 0, host h): out of memory: ...`` on stderr, the same line
  (with the traceback) in torchrun's per-rank error file (``TORCHELASTIC_ERROR_FILE``, the file
  torch.distributed.elastic's ``@record`` writes), and exit status 1.
- In the launcher, :func:`child_failure_lines` and :func:`rendezvous_failure_line` turn what
  torchrun's agent raises (``ChildFailedError`` with its per-rank failures, rendezvous errors)
  into such lines; a rank killed by a signal has no error file, and its line names the signal.

Causes recognised: out of memory, a missing GPU, communication errors (NCCL, gloo, a peer that
died), timeouts of the process-group store or of collectives (``parallel.collective_timeout_s``).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager

from scaletool.errors import JoinError, RecipeError, _first_line, describe, rank_label  # noqa: F401 (re-exported for launchers)


def _write_error_file(line: str) -> str | None:
    """The failure in torchrun's error-file format (what ``@record`` writes), with our line as the message."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return None
    data = {"message": {"message": line, "extraInfo": {"py_callstack": traceback.format_exc(),
                                                      "timestamp": str(int(time.time()))}}}
    with open(path, "w") as fp:
        json.dump(data, fp)
    return path


@contextmanager
def reported_failures():
    """Run a rank's work; an unexpected exception becomes one ``error:`` line naming the rank and
    cause, torchrun's error file, and exit status 1. Recipe errors (already one clear line each),
    ``SystemExit`` and Ctrl-C pass through."""
    try:
        yield
    except (RecipeError, SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - every other failure of the rank is reported, then exits 1
        line = f"error: {rank_label()}: {describe(exc)}"
        where = _write_error_file(line)
        if where is None and not isinstance(exc, JoinError):  # no launcher to hold the traceback: it goes
            traceback.print_exc()  # to stderr, above the line (a join timeout's line says all there is)
        print(line + (f" [traceback in {where}]" if where else ""), file=sys.stderr, flush=True)
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# The launcher's side


def _failure_message(failure) -> str:
    m = failure.message
    return m.get("message", "") if isinstance(m, dict) else (m or "")


def _is_consequence(line: str) -> bool:
    """A rank that failed because a peer did: its collective errored or timed out (see :func:`describe`), or
    it was stopped or killed by SIGTERM or SIGINT, as the agent stops every rank once one has failed (a rank
    that the agent's SIGTERM reaches after its trainer has returned, while it reports a peer's failure, dies
    of it with the default action)."""
    return ("communication error" in line or "communication timed out" in line or "stopped by SIG" in line
            or line.endswith(("killed by SIGTERM", "killed by SIGINT")))


def _failure_line(rank: int, f) -> str:
    msg = _failure_message(f)
    if msg.startswith("error: "):  # written by reported_failures on that rank
        return msg
    who = f"rank {rank} (local rank {f.local_rank}, pid {f.pid})"
    if f.exitcode < 0:
        sig = signal.Signals(-f.exitcode).name if -f.exitcode in signal.valid_signals() else str(-f.exitcode)
        hint = " (killed from outside: the host's OOM killer, a scheduler or a user)" if sig == "SIGKILL" else ""
        return f"error: {who}: killed by {sig}{hint}"
    stop = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGINT: "SIGINT"}.get(f.exitcode)
    if stop is not None:  # the trainer's clean stop on the agent's signal: it ended the step, then exited 128 + N
        return f"error: {who}: stopped by {stop} (exit status {f.exitcode})"
    return f"error: {who}: exited with status {f.exitcode}; its output is above"


def child_failure_lines(err) -> list[str]:
    """One line per failed rank of a ``torch.distributed.elastic ChildFailedError``, root cause first.

    The root cause is the earliest failure that is not a consequence: a rank whose collective failed
    because a peer died, or that the agent stopped after the peer died, writes its error file (with its
    timestamp, in whole seconds) as early as the agent notices the dead peer, whose failure is stamped
    when noticed. Then the other
    causes, then the consequences, each by rank.
    """
    lines = {rank: _failure_line(rank, f) for rank, f in err.failures.items()}
    causes = [r for r in lines if not _is_consequence(lines[r])] or list(lines)
    root = min(causes, key=lambda r: (err.failures[r].timestamp, r))
    return [lines[r] for r in sorted(lines, key=lambda r: (r != root, _is_consequence(lines[r]), r))]


def rendezvous_failure_line(exc: BaseException, endpoint: str, run_id: str, nnodes: int, timeout_s: int) -> str:
    """The line for a rendezvous that did not form, could not be reached, or was closed."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    where = f"rendezvous '{run_id}' at {endpoint}"
    if isinstance(exc, RendezvousTimeoutError):
        return (f"error: {where}: {nnodes} nodes did not all join within {timeout_s} s (--rdzv-timeout); start "
                "the launch on every node with the same --rdzv-endpoint and --rdzv-id, and check that the "
                "endpoint's port is reachable from each")
    if isinstance(exc, RendezvousConnectionError):
        return (f"error: {where}: lost the rendezvous store (the node hosting it has not started, has ended, or "
                f"is unreachable): {_first_line(str(exc.__cause__ or exc))}")
    if isinstance(exc, RendezvousClosedError):
        return f"error: {where}: closed by another node (it finished or failed; see its output)"
    return f"error: {where}: {type(exc).__name__}: {_first_line(str(exc))}"
