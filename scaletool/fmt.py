"""Output helpers every layer may use: human-readable numbers, and the one JSON writer.

- :func:`si`, :func:`gib`, :func:`pct`: numbers for tables and log lines.
- :func:`clean` and :func:`emit_json`: JSON without NaN/Inf (null instead), sorted for diffing.
- :func:`stdout_to_stderr`: keep stdout for a command's own ``--json`` while workers print.
- :func:`write_atomic`: a file replaced whole or not at all.
- :func:`open_state`: a file scaletool keeps in its own directories, opened never through a link.

Files scaletool names itself inside a run, sweep or report directory (``summary.json``,
``results.jsonl``, ``.lock``, ``report.md``, ...) are never written through a symbolic link or into
a FIFO or device planted in their place: that is an OSError naming why (:data:`LINK_REFUSED`). A
path the user names (``--result-file``, ``-o``, ``--script``) is followed like a shell redirection.
"""
from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

#: what a contended timed figure carries wherever it is shown (console tables, report cells): another
#: process held a CPU (or the GPU) the run waited for, so the figure is not this machine's (scaletool.measure.contention)
CONTENDED_MARK = "⚠"


def si(x: float | None, unit: str = "", digits: int = 3) -> str:
    """1.23e9 -> '1.23 G'."""
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


def gib(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    if abs(x) >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB"


def pct(x: float | None, digits: int = 2, *, signed: bool = True) -> str:
    """0.123 -> '+12.30%' (a change or an error), or '12.3%' with ``signed=False`` (a share)."""
    if x is None:
        return "-"
    return f"{100 * x:+.{digits}f}%" if signed else f"{100 * x:.{digits}f}%"


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]}
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029"})


def printable(text: object) -> str:
    """``text`` with its control characters written as escapes (ESC as ``\\x1b``, a newline as ``\\x0a``):
    text read from a file or another process (a run label, a lock holder's command, a study's description)
    is shown, never executed by the terminal (cursor moves, colour, a title change, a cleared screen)."""
    return str(text).translate(_CONTROL)


def clean(obj):
    """JSON-safe copy: NaN/Inf become None (JSON has no NaN), tuples become lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def emit_json(obj) -> None:
    """The single place JSON goes to stdout: sorted for diffing, no NaN/Inf (null instead)."""
    sys.stdout.write(json.dumps(clean(obj), indent=2, sort_keys=True) + "\n")


LINK_REFUSED = "is a symbolic link; scaletool does not write its own files through links (remove it)"
NOT_REGULAR = "not a regular file; scaletool keeps its own files as regular files (remove it)"
FIFO_UNREAD = "a FIFO that no process is reading; start the reader first"


def _refusal(code: int, reason: str, path) -> OSError:
    """An OSError that names ``path`` and says why it was refused (``refusal``: no more to add)."""
    e = OSError(code, reason, str(path))
    e.refusal = True
    return e


def refuse_link(path: Path) -> None:
    """A directory scaletool names inside its own (``plots``, ``points/...``): never a link (the OSError)."""
    if os.path.islink(path):
        raise _refusal(errno.ELOOP, LINK_REFUSED, path)


def refused(e: OSError) -> bool:
    """Whether ``e`` is a refusal of :func:`open_state` or :func:`write_atomic` (its reason says all)."""
    return bool(getattr(e, "refusal", False))


def open_state(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file scaletool keeps in its own directory: never through a symbolic link
    (``O_NOFOLLOW``), never a FIFO or device (checked on the open descriptor, which a FIFO does not
    block). Raises OSError with :data:`LINK_REFUSED` or :data:`NOT_REGULAR` as its reason."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise _refusal(errno.ELOOP, LINK_REFUSED, path) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing
            raise _refusal(errno.ENXIO, NOT_REGULAR, path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refusal(errno.EINVAL, NOT_REGULAR, path)
    os.set_blocking(fd, True)
    return fd


def _write_special(path: Path, data: str | bytes) -> None:
    """Write into a device or FIFO the user named; a FIFO nobody reads is an error, not a wait forever."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise _refusal(errno.ENXIO, FIFO_UNREAD, path) from None
        raise
    os.set_blocking(fd, True)
    with open(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_atomic(path: Path, data: str | bytes, *, follow_links: bool = False) -> None:
    """Write ``path`` through a temporary file beside it and a rename: a reader, a kill or a full disk never
    leaves it half-written, and the file it replaces survives a failed write. Raises the OSError.

    By default ``path`` is one of scaletool's own files: a symbolic link, FIFO or device there is refused
    (:func:`open_state`'s reasons). ``follow_links`` for a path the user named: a link keeps pointing where
    it did while the file it names is replaced, and a device or a FIFO (with a reader) is written to as
    it is (renaming over it would put a file where the device was, and as root it can).
    """
    path = Path(path)
    try:
        st = path.stat() if follow_links else path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        st = None  # a new file (or a path that cannot be one: creating it below says why)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise _refusal(errno.ELOOP, LINK_REFUSED, path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        if not follow_links:
            raise _refusal(errno.EINVAL, NOT_REGULAR, path)
        _write_special(path, data)
        return
    if follow_links and path.is_symlink():
        path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            fd = open_state(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:  # left by a killed writer of the same pid (or planted): never written through
            tmp.unlink()
            fd = open_state(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with open(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


@contextmanager
def stdout_to_stderr(enabled: bool = True):
    """Point file descriptor 1 at stderr (inherited by every worker a command starts), so that stdout
    carries only the command's own --json."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
