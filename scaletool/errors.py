"""Error types and one-line failure descriptions, low enough in the package for every layer to use.

- :class:`RecipeError`: a recipe, file or option that cannot be used; one human-readable line per
  problem. The CLI prints each as ``error: ...`` and exits with status 2.
- :class:`JoinError`: ranks started without a rendezvous of the launcher's own (the DeepSpeed
  launcher) that did not all meet in time, or could not host their store; its message is the whole cause.
- :func:`describe`: ``cause: detail`` for an exception raised while running (out of memory, a missing
  GPU, communication errors and timeouts), and :func:`rank_label`, the rank it happened on.
- :func:`echo`, :func:`shorten`: a value from user input (a path, a key), cut for a one-line message.
- :func:`cannot_write`: a write that fails (full or read-only disk, a path under a file) as one line.
- :func:`validation_lines`: a pydantic ``ValidationError`` as one line per problem.
- :func:`positive_int`, :func:`positive_finite`: a library argument checked at the edge (one line when not).
"""
from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
import socket
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot be used; ``problems`` holds one human-readable line per problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class JoinError(RuntimeError):
    """The ranks did not all join the process group's store within the join timeout (a node that never
    started, an address or port its peers cannot reach), or rank 0 could not listen on its port."""


# Input echoed in a message can be anything a file holds (a megabyte string, a 10**4000 integer, an alias
# tree of a billion nodes): reprlib cuts strings, numbers and containers and visits only what it shows.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlong = 24
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = 6
_SHORT.maxdict = 4
_SHORT.maxlevel = 2


def shorten(text: str, limit: int = 160) -> str:
    """``text`` as it is up to ``limit`` characters, else its start and end around '...' (for paths and keys,
    which read best unquoted)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit // 2 - 2]}...{text[-(limit // 2 - 1):]}"


def echo(value: Any) -> str:
    """``repr(value)``, bounded for a one-line message: long strings, numbers and containers are cut with '...'."""
    try:
        text = _SHORT.repr(value)
    except ValueError:  # an int too long for a decimal repr (sys.get_int_max_str_digits)
        return f"<a {value.bit_length()}-bit integer>" if isinstance(value, int) else f"<{type(value).__name__}>"
    return text if len(text) <= 100 else text[:97] + "..."


@contextmanager
def cannot_write(where: object, what: str = ""):
    """An OSError inside (a full or read-only disk, a path under a file, a missing parent) becomes the
    :class:`RecipeError` ``<where>: cannot write [what] (<reason>)``: one ``error:`` line, exit 2. ``where``
    (a path) is shortened to fit the line."""
    try:
        yield
    except OSError as e:
        if getattr(e, "refusal", False):  # a link or FIFO where scaletool writes its own file: the path says it
            raise RecipeError(f"{shorten(str(e.filename))}: {e.strerror}") from None
        raise RecipeError(f"{shorten(str(where))}: cannot write{' ' + what if what else ''} ({e.strerror or e})") \
            from None


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
    if isinstance(exc, JoinError):
        return text
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


def validation_lines(exc: Any, source: str, *, root: str = "", known: Callable[[tuple], Sequence[str]] | None = None,
                     many_keys: Callable[[tuple], str] | None = None, key_text: Callable[[Any], str] = str,
                     show_input: Callable[[dict], bool] | None = None, limit: int | None = None,
                     messages: dict[str, str] | None = None) -> list[str]:
    """A pydantic ``ValidationError`` (``exc.errors()``; duck-typed, pydantic not imported here) as one line
    per problem: ``source: where: message (got value)``.

    A :class:`RecipeError` raised inside a validator gives its own lines. An unknown key names the closest
    known one, ``known(parent location)`` (else lists them, up to 12; past that ``many_keys(parent)`` says
    where they are listed). ``root``: the location's name when it is empty; ``key_text`` writes one part of
    a location; ``show_input(error)`` whether to echo the value (default: not mappings or lists);
    ``limit``: at most that many errors; ``messages``: a message of one's own per pydantic error type."""
    lines: list[str] = []
    for err in exc.errors()[:limit]:
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, RecipeError):
            lines += [f"{source}: {p}" for p in inner.problems]
            continue
        loc = tuple(err["loc"])
        where = ".".join(key_text(p) for p in loc) or root
        if err["type"] == "extra_forbidden":
            keys = list(known(loc[:-1])) if known else []
            hint = difflib.get_close_matches(str(loc[-1])[:200], keys, n=1, cutoff=0.6)
            if hint:
                tip = f"; did you mean '{hint[0]}'?"
            elif 0 < len(keys) <= 12 or (keys and many_keys is None):
                tip = f"; known keys: {', '.join(keys)}"
            else:  # a long list would bury the line
                tip = f"; {many_keys(loc[:-1])}" if many_keys and keys else ""
            lines.append(f"{source}: {where}: unknown key{tip}")
            continue
        got = err.get("input")
        shown = show_input(err) if show_input else not isinstance(got, (dict, list))
        msg = (messages or {}).get(err["type"]) or err["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {where}: {msg}{f' (got {echo(got)})' if shown else ''}")
    return lines


def positive_int(name: str, value: Any) -> int:
    """``value`` when it is an int >= 1 (not a bool), else a RecipeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{name}: expected a positive integer, got {str(value)[:40]!r}")
    return value


def positive_finite(name: str, value: Any) -> float | None:
    """None, or a finite number > 0 as a float (a NaN or infinite peak or budget would pass every comparison)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RecipeError(f"{name}: expected a finite number > 0, got {str(value)[:40]!r}")
    return float(value)
