"""The results store: ``results.jsonl``, append-only, one JSON line per finished (point, mode, repeat).

A line is written with a single ``os.write`` on an ``O_APPEND`` descriptor, under an exclusive
``flock`` of the file (writers on other nodes, Slurm array tasks on a shared file system, never
interleave), and fsync'd, so a killed writer leaves either the whole line or none of it; should a torn
line exist anyway (a full disk, a foreign writer), the reader skips it with a warning and the writer
starts a fresh line after it. Every line is validated as a :class:`~scaletool.results.sweep.SweepRecord`
on read: a hand-edited or foreign line is skipped with one warning, like a torn one. Later lines win
over earlier ones with the same key (``--retry-failed`` appends, never rewrites).
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from scaletool.errors import RecipeError
from scaletool.fmt import LINK_REFUSED, clean, open_state, refused
from scaletool.results import ResultLoadError
from scaletool.results.sweep import SweepRecord, load_record

RESULTS_FILE = "results.jsonl"


def append_record(results_dir: Path, record: SweepRecord | dict) -> None:
    """Append one record as one line, atomically with respect to a kill of this process and to other
    writers; a failed write (full or read-only disk) is one RecipeError line, earlier lines intact."""
    path = Path(results_dir) / RESULTS_FILE
    data = record.model_dump(mode="json") if isinstance(record, SweepRecord) else record
    line = (json.dumps(clean(data), sort_keys=True, default=str, allow_nan=False) + "\n").encode()
    try:
        fd = open_state(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
            if _ends_torn(fd):
                line = b"\n" + line
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(0, f"short write ({written} of {len(line)} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if refused(e):
            raise RecipeError(f"{path}: {e.strerror}") from None
        raise RecipeError(f"{path}: cannot record a result: {e.strerror or e}; the results recorded "
                          "before are intact (free space or fix permissions, then rerun to resume)") from None


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def load_records(results_dir: Path) -> tuple[list[SweepRecord], list[str]]:
    """All valid records in file order, and one warning per line that is torn, not JSON or not a record."""
    path = Path(results_dir) / RESULTS_FILE
    if path.is_symlink():
        raise RecipeError(f"{path}: {LINK_REFUSED}")
    if not path.exists():
        return [], []
    if not path.is_file():
        raise RecipeError(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read: {e.strerror or e}") from None
    records, warnings = [], []
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.append(f"{path}:{n}: unreadable line (torn write?), ignored")
            continue
        try:
            records.append(load_record(raw, "record"))
        except ResultLoadError as e:
            why = e.problems[0].removeprefix("record: ").replace(": Value error, ", ".")
            warnings.append(f"{path}:{n}: not a sweep record ({why}), ignored")
    return records, warnings


def read_records(results_dir: Path) -> tuple[list[dict], list[str]]:
    """:func:`load_records` as plain dicts (the validated records, older schemas brought up to date)."""
    records, warnings = load_records(results_dir)
    return [r.model_dump(mode="json") for r in records], warnings


def latest_by_key(records: list) -> dict[str, dict | SweepRecord]:
    """The last record of every key, in order of first appearance (records as dicts or models)."""
    out: dict = {}
    for r in records:
        out[r["key"] if isinstance(r, dict) else r.key] = r
    return out
