"""The results store: ``results.jsonl``, append-only, one JSON line per finished (point, mode).

A line is written with a single ``os.write`` on an ``O_APPEND`` descriptor and fsync'd, so a killed
sweep leaves either the whole line or none of it; should a torn line exist anyway (a full disk, a
foreign writer), the reader skips it with a warning and the writer starts a fresh line after it.
Later lines win over earlier ones with the same key (``--retry-failed`` appends, never rewrites).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS_FILE = "results.jsonl"


def append_record(results_dir: Path, record: dict) -> None:
    """Append one record as one line, atomically with respect to a kill of this process."""
    path = Path(results_dir) / RESULTS_FILE
    line = (json.dumps(record, sort_keys=True, default=str, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if _ends_torn(fd):
            line = b"\n" + line
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"{path}: short write ({written} of {len(line)} bytes); disk full?")
        os.fsync(fd)
    finally:
        os.close(fd)


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def read_records(results_dir: Path) -> tuple[list[dict], list[str]]:
    """All intact records in file order, and one warning per line that could not be read."""
    path = Path(results_dir) / RESULTS_FILE
    if not path.exists():
        return [], []
    records, warnings = [], []
    for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.append(f"{path}:{n}: unreadable line (torn write?), ignored")
            continue
        if not isinstance(rec, dict) or "key" not in rec or "status" not in rec:
            warnings.append(f"{path}:{n}: not a result record, ignored")
            continue
        records.append(rec)
    return records, warnings


def latest_by_key(records: list[dict]) -> dict[str, dict]:
    """The last record of every key, in order of first appearance."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["key"]] = r
    return out
