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
import re
import signal
import socket
import sys
import time
import traceback
from contextlib import contextmanager

from scaletool.config import RecipeError

# Gloo and c10d prefix messages with the C++ source location: "[/__w/pytorch/.../pair.cc:553] ".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def rank_label(environ=None) -> str:
    """``rank R/W (node N, local rank L, host H)`` from the launcher's environment variables
    (torchrun: GROUP_RANK; the DeepSpeed launcher: CROSS_RANK)."""
    e = os.environ if environ is None else environ
    node = e.get("GROUP_RANK", e.get("CROSS_RANK"))
    where = [f"node {node}"] if node is not None else []
    where += [f"local rank {e.get('LOCAL_RANK', 0)}", f"host {socket.gethostname()}"]
    return f"rank {e.get('RANK', 0)}/{e.get('WORLD_SIZE', 1)} ({', '.join(where)})"


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = _SOURCE_PREFIX.sub("", lines[0]) if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _cuda_devices() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def describe(exc: BaseException, environ=None) -> str:
    """``cause: detail`` for an exception raised on a rank."""
    import torch
    import torch.distributed as dist

    e = os.environ if environ is None else environ
    text = str(exc)
    low = text.lower()
    detail = _first_line(text)
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in low:
        return (f"out of memory: {detail} (lower train.micro_batch_size, turn on train.activation_checkpointing, "
                "or shard more: parallel.engine=fsdp or deepspeed with a higher zero_stage)")
    if "invalid device ordinal" in low or "no cuda gpus are available" in low:
        visible = e.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        return (f"missing GPU: local rank {e.get('LOCAL_RANK', 0)} needs its own GPU, but this node shows "
                f"{_cuda_devices()} CUDA device(s){shown}; lower --nproc-per-node to the GPUs per node")
    timed_out = "timed out" in low or "timeout" in low
    comm = (isinstance(exc, dist.DistError) or any(w in text for w in ("NCCL", "Gloo", "gloo", "c10d"))
            or "connection closed by peer" in low or "connection reset" in low)
    if comm:
        # Gloo and NCCL add paragraphs of advice after the cause: keep the first sentence.
        detail = re.split(r"(?<=[.!])\s", detail, maxsplit=1)[0]
    if comm and timed_out:
        return (f"communication timed out: {detail} (a peer rank stopped or hangs; the limit is "
                "parallel.collective_timeout_s)")
    if comm:
        backend = "NCCL" if "nccl" in low else "gloo" if "gloo" in low else "torch.distributed"
        return f"communication error ({backend}): {detail} (a peer rank failed or was killed: see its line)"
    return f"{type(exc).__name__}: {detail}"


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
        if where is None:  # no launcher to hold the traceback: it goes to stderr, above the line
            traceback.print_exc()
        print(line + (f" [traceback in {where}]" if where else ""), file=sys.stderr, flush=True)
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# The launcher's side


def _failure_message(failure) -> str:
    m = failure.message
    return m.get("message", "") if isinstance(m, dict) else (m or "")


def child_failure_lines(err) -> list[str]:
    """One line per failed rank of a ``torch.distributed.elastic ChildFailedError``, root cause first."""
    first_rank, _ = err.get_first_failure()
    lines = []
    for rank in sorted(err.failures, key=lambda r: (r != first_rank, r)):
        f = err.failures[rank]
        msg = _failure_message(f)
        if msg.startswith("error: "):  # written by reported_failures on that rank
            lines.append(msg)
            continue
        who = f"rank {rank} (local rank {f.local_rank}, pid {f.pid})"
        if f.exitcode < 0:
            sig = signal.Signals(-f.exitcode).name if -f.exitcode in signal.valid_signals() else str(-f.exitcode)
            hint = " (killed from outside: the host's OOM killer, a scheduler or a user)" if sig == "SIGKILL" else ""
            lines.append(f"error: {who}: killed by {sig}{hint}")
        else:
            lines.append(f"error: {who}: exited with status {f.exitcode}; its output is above")
    return lines


def rendezvous_failure_line(exc: BaseException, endpoint: str, run_id: str, nnodes: int, timeout_s: int) -> str:
    """The line for a rendezvous that did not form, could not be reached, or was closed."""
    from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousConnectionError,
                                                      RendezvousTimeoutError)
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
