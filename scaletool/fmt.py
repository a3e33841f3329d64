"""Output helpers every layer may use: human-readable numbers, and the one JSON writer.

- :func:`si`, :func:`gib`, :func:`pct`: numbers for tables and log lines.
- :func:`clean` and :func:`emit_json`: JSON without NaN/Inf (null instead), sorted for diffing.
- :func:`stdout_to_stderr`: keep stdout for a command's own ``--json`` while workers print.
- :func:`write_atomic`: a file replaced whole or not at all.
"""
from __future__ import annotations

import json
import math
import os
import stat
import sys
from contextlib import contextmanager, suppress
from pathlib import Path


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


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``path`` through a temporary file beside it and a rename: a reader, a kill or a full disk never
    leaves it half-written, and the file it replaces survives a failed write. Raises the OSError.

    Only a regular file (or a new one) is replaced: a device, a FIFO or ``/dev/stdout`` is written to as
    it is (renaming over it would put a file where the device was, and as root it can), and a symbolic
    link keeps pointing where it did while the file it names is replaced.
    """
    path = Path(path)
    try:
        regular = stat.S_ISREG(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        regular = True  # a new file (or a path that cannot be one: creating it below says why)
    if not regular:
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        return
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
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
