"""A run folder's record files, loose or bundled: the one reader of ``benchmarks/results``.

A committed run folder (``benchmarks/results/STUDY/CARD-DATE[-LABEL]/``) keeps its record files (``.json``,
``.jsonl``, ``.csv``, ``.txt``, subfolders included) in one xz-compressed bundle, :data:`BUNDLE`: one JSON line
per file, ``{"path": "<path relative to the folder>", "text": "<the file's exact text>"}``, sorted by path.
Records of one run repeat their recipes, environments and keys, so compressed together they take a tenth
of their size (6.6 MB of records in 0.67 MB), where each file compressed alone keeps most of it. What a
person reads first stays loose: the generated ``README.md``, ``provenance.json`` and any hand-written
``.md`` (a report's generated ``report.md`` is bundled, :data:`BUNDLED_NAMES`). The benchmark runner writes
loose files; ``python -m scaletool.bench pack`` bundles them before they are committed, ``unpack`` writes them
out again, byte for byte.

Every reader goes through here: :func:`iter_record_files` (a folder's records, bundled and loose),
:func:`read_record` (one record by the path it has unpacked), :func:`walk_records` (every record under a
root). A bundle is read like any other input of scaletool's, bounded: at most :data:`MAX_BUNDLE_BYTES` on
disk, its xz stream decoded with a memory limit and cut at :data:`MAX_UNPACKED_BYTES`, each line checked
(a relative path without ``..``, a record's suffix, sorted and unique) before any of it is used; a bundle
that is not so is one :class:`RecipeError` line.
"""
from __future__ import annotations

import functools
import json
import lzma
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from scaletool.errors import RecipeError, echo, shorten
from scaletool.fmt import printable, write_atomic
from scaletool.resources import read_bounded

#: a run folder's bundle of record files
BUNDLE = "records.jsonl.xz"
#: the suffixes of record files: what a bundle holds
RECORD_SUFFIXES = (".json", ".jsonl", ".csv", ".txt", ".err")
#: record files kept loose: read by a person (and by git blame) before anything else
LOOSE_NAMES = frozenset({"provenance.json"})
#: generated text bundled like a record: ``scaletool report``'s report.md (the regenerate-reports study writes
#: it again from the bundled results); a hand-written ``.md`` stays loose
BUNDLED_NAMES = frozenset({"report.md"})
#: the largest bundle read: the largest committed one is under 100 KiB
MAX_BUNDLE_BYTES = 64 << 20
#: the most a bundle may hold decoded: a hostile bundle (a few KiB of xz decode to gigabytes) stops here
MAX_UNPACKED_BYTES = 256 << 20
#: the xz decoder's memory: preset 9's 64 MiB dictionary and its buffers; a header asking for more is refused
MAX_DECODER_MEMORY = 128 << 20
#: the largest loose record file read (the largest committed record is under 1 MiB)
MAX_RECORD_BYTES = 64 << 20
MAX_FILES = 10_000
MAX_PATH_CHARS = 400
#: lzma's strongest preset: deterministic (the same records give the same bytes with the same liblzma), and the
#: bundles are written once and read many times
PRESET = 9 | lzma.PRESET_EXTREME
_XZ_MAGIC = b"\xfd7zXZ\x00"


def _record_like(name: str) -> bool:
    """A record file's name (a record's suffix or a bundled name, not hidden), loose names included."""
    return (name.endswith(RECORD_SUFFIXES) or name in BUNDLED_NAMES) and not name.startswith(".")


def is_record_name(name: str) -> bool:
    """Whether a file of this name belongs in a bundle."""
    return _record_like(name) and name not in LOOSE_NAMES


def path_problem(rel: object) -> str | None:
    """Why ``rel`` is not the path of a record file inside a run folder, or None: a relative POSIX path of
    plain names (no ``..``, ``.``, empty or hidden part, no backslash or control character) ending in a
    record's suffix. A bundle holds nothing else, so unpacking one writes nothing else."""
    if not isinstance(rel, str) or not rel:
        return f"the path {echo(rel)} is not a non-empty string"
    if len(rel) > MAX_PATH_CHARS:
        return f"the path {echo(rel)} is longer than {MAX_PATH_CHARS} characters"
    if rel.startswith("/"):
        return f"the path {echo(rel)} is absolute"
    if any(not c.isprintable() for c in rel) or "\\" in rel:
        return f"the path {echo(rel)} holds a control character or a backslash"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"the path {echo(rel)} has an empty, '.' or '..' part"
    if any(p.startswith(".") for p in parts):
        return f"the path {echo(rel)} has a hidden part"
    if not is_record_name(parts[-1]):
        return f"the path {echo(rel)} is not a record file ({', '.join(RECORD_SUFFIXES)}; not {', '.join(sorted(LOOSE_NAMES))})"
    return None


#: characters JSON leaves raw that str.splitlines (and other line readers) take for line ends: escaped, so one
#: file stays one line for any reader
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def encode(entries: Mapping[str, str]) -> bytes:
    """The bundle of ``entries`` (path -> text): JSON lines sorted by path, xz at :data:`PRESET`."""
    lines = [json.dumps({"path": rel, "text": entries[rel]}, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"
             for rel in sorted(entries)]
    return lzma.compress("".join(lines).encode("utf-8"), format=lzma.FORMAT_XZ, preset=PRESET)


def decode(blob: bytes, where: str) -> dict[str, str]:
    """The entries of a bundle's bytes, each line checked; :class:`RecipeError` naming ``where`` otherwise."""
    if not blob.startswith(_XZ_MAGIC):
        raise RecipeError(f"{where}: not an xz bundle of records (no xz header)")
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=MAX_DECODER_MEMORY)
    try:
        data = dec.decompress(blob, max_length=MAX_UNPACKED_BYTES + 1)
    except lzma.LZMAError as e:
        raise RecipeError(f"{where}: not an xz bundle of records ({printable(str(e))})") from None
    if len(data) > MAX_UNPACKED_BYTES:
        raise RecipeError(f"{where}: decodes to more than {MAX_UNPACKED_BYTES >> 20} MiB; a run's records are a few MiB")
    if not dec.eof:
        raise RecipeError(f"{where}: the xz stream is cut short")
    if dec.unused_data:
        raise RecipeError(f"{where}: {len(dec.unused_data)} bytes follow the xz stream")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{where}: not UTF-8 (byte {e.start})") from None
    lines = text.split("\n")
    if lines[-1] != "":
        raise RecipeError(f"{where}: its last line is not ended")
    if len(lines) - 1 > MAX_FILES:
        raise RecipeError(f"{where}: more than {MAX_FILES:,} files")
    entries: dict[str, str] = {}
    last = None
    for i, line in enumerate(lines[:-1], 1):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise RecipeError(f"{where}: line {i} is not JSON") from None
        if not isinstance(rec, dict) or set(rec) != {"path", "text"} or not isinstance(rec["text"], str):
            raise RecipeError(f'{where}: line {i} is not {{"path": ..., "text": ...}} with text a string')
        problem = path_problem(rec["path"])
        if problem:
            raise RecipeError(f"{where}: line {i}: {printable(problem)}")
        if last is not None and rec["path"] <= last:
            raise RecipeError(f"{where}: line {i}: {printable(echo(rec['path']))} is out of order or given twice")
        last = rec["path"]
        entries[rec["path"]] = rec["text"]
    return entries


@functools.lru_cache(maxsize=8)
def _read_cached(path: str, key: tuple[int, int, int, int]) -> Mapping[str, str]:
    del key  # part of the cache key only: a bundle rewritten in place is read again
    return MappingProxyType(decode(read_bounded(path, MAX_BUNDLE_BYTES, "a bundle of records"), shorten(path)))


def read_bundle(path: str | Path) -> Mapping[str, str]:
    """A bundle's entries (path -> text), read-only. A bundle is read once while it is unchanged (readers
    look up its files one by one); a link, FIFO or anything else that is not a regular file is refused."""
    path = Path(path)
    try:
        st = path.lstat()
    except OSError as e:
        raise RecipeError(f"{shorten(path)}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RecipeError(f"{shorten(path)}: not a regular file")
    return _read_cached(str(path), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def read_loose(path: str | Path) -> str:
    """A loose record file's text: a regular file, not through a link, at most :data:`MAX_RECORD_BYTES`, UTF-8."""
    path = Path(path)
    if path.is_symlink():
        raise RecipeError(f"{shorten(path)}: is a symbolic link; a record is a regular file")
    blob = read_bounded(path, MAX_RECORD_BYTES, "a record file")
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{shorten(path)}: not a UTF-8 text file (byte {e.start})") from None


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class Record:
    """One record file of a folder: ``rel`` under ``folder``, in the folder's bundle or loose."""

    folder: Path
    rel: str
    bundled: bool

    @property
    def path(self) -> Path:
        """Where the file is, or would be once unpacked."""
        return self.folder / self.rel

    def text(self) -> str:
        return read_bundle(self.folder / BUNDLE)[self.rel] if self.bundled else read_loose(self.path)


def _loose_files(folder: Path) -> list[str]:
    """The relative paths of the loose record files under ``folder`` (subfolders too; links not followed,
    hidden folders and names skipped), sorted."""
    out = []
    for here, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_dir = Path(here).relative_to(folder)
        for name in files:
            if _record_like(name):
                out.append((rel_dir / name).as_posix())
        if len(out) > MAX_FILES:
            raise RecipeError(f"{shorten(folder)}: more than {MAX_FILES:,} record files")
    return sorted(out)


def records(folder: str | Path) -> list[Record]:
    """Every record file of ``folder``: its bundle's and the loose ones (``provenance.json`` among them), sorted
    by path. A file both loose and bundled is given once, the bundled copy, when the two are the same;
    when they differ it is a :class:`RecipeError` (which one is the record?)."""
    folder = Path(folder)
    bundle = folder / BUNDLE
    entries = read_bundle(bundle) if bundle.exists() or bundle.is_symlink() else {}
    out = {rel: Record(folder, rel, True) for rel in entries}
    for rel in _loose_files(folder):
        if rel in out:
            if read_loose(folder / rel) != entries[rel]:
                raise RecipeError(f"{shorten(folder / rel)}: differs from its copy in {BUNDLE}; keep one "
                                  f"(python -m scaletool.bench pack refuses to choose)")
            continue
        out[rel] = Record(folder, rel, False)
    return [out[rel] for rel in sorted(out)]


def iter_record_files(folder: str | Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every record file of ``folder``, bundled and loose, sorted by path."""
    for r in records(folder):
        yield r.rel, r.text()


def walk_records(root: str | Path) -> list[Record]:
    """Every record file under ``root``, each folder's bundle read as if unpacked (links not followed),
    sorted by path."""
    root = Path(root)
    out: dict[Path, Record] = {}
    for here, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if BUNDLE in files:
            for r in records(Path(here)):
                out.setdefault(r.path, r)
        else:
            for name in files:
                if _record_like(name) and _regular(Path(here) / name):
                    out.setdefault(Path(here) / name, Record(Path(here), name, False))
    return [out[p] for p in sorted(out)]


def glob(root: str | Path, pattern: str) -> list[Path]:
    """The records under ``root`` (loose or bundled, by the paths they have unpacked) whose path relative to
    ``root`` matches ``pattern`` part by part (``fnmatch`` in each part, as many parts: ``decode/h100-*/*.json``),
    sorted. What ``root.glob(pattern)`` gave before the records were bundled."""
    import fnmatch

    want = pattern.split("/")
    if "**" in want:
        raise ValueError("records.glob matches part by part; walk_records gives every record under a root")
    root = Path(root)
    out = []
    for r in walk_records(root):
        parts = r.path.relative_to(root).parts
        if len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want)):
            out.append(r.path)
    return out


def find(path: str | Path) -> Record | None:
    """The record whose path (unpacked) is ``path``: the loose file, or the entry of the bundle in the nearest
    folder above it that holds one; None when neither has it."""
    path = Path(path)
    if os.path.lexists(path):  # a loose file, read (or refused: a link, a FIFO) as one
        return Record(path.parent, path.name, False)
    for folder in path.parents:
        bundle = folder / BUNDLE
        if bundle.exists() or bundle.is_symlink():
            rel = path.relative_to(folder).as_posix()
            return Record(folder, rel, True) if rel in read_bundle(bundle) else None
    return None


def exists(path: str | Path) -> bool:
    """Whether ``path`` is a record, loose or bundled (a bundle that cannot be read: False)."""
    try:
        return find(path) is not None
    except RecipeError:
        return False


def read_record(path: str | Path) -> str:
    """The text of the record file ``path``, loose or bundled (:func:`find`)."""
    r = find(path)
    if r is None:
        raise RecipeError(f"{shorten(path)}: no such file, loose or in a {BUNDLE} above it")
    return r.text()


@dataclass(frozen=True)
class Packed:
    folder: Path
    files: int  # record files the bundle holds
    added: int  # loose files moved into it
    loose_bytes: int
    bundle_bytes: int


def pack(folder: str | Path) -> Packed:
    """Move ``folder``'s loose record files (``provenance.json`` aside) into its bundle: written whole or not at
    all, read back and compared before any loose file is removed. A loose file that differs from its bundled
    copy, a link, or a file that is not UTF-8 is refused (:class:`RecipeError`) and nothing changes. Folders
    the loose files leave empty are removed. Raises OSError where the bundle cannot be written."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise RecipeError(f"{shorten(folder)}: not a directory")
    bundle = folder / BUNDLE
    old = dict(read_bundle(bundle)) if bundle.exists() or bundle.is_symlink() else {}
    entries, moved, loose_bytes = dict(old), [], 0
    for rel in _loose_files(folder):
        if not is_record_name(Path(rel).name):
            continue
        problem = path_problem(rel)
        if problem:
            raise RecipeError(f"{shorten(folder / rel)}: cannot be bundled: {printable(problem)}")
        text = read_loose(folder / rel)
        if rel in old and old[rel] != text:
            raise RecipeError(f"{shorten(folder / rel)}: differs from its copy in {BUNDLE}; keep one (remove the "
                              f"loose file, or unpack, remove {BUNDLE} and pack again)")
        entries[rel] = text
        moved.append(rel)
        loose_bytes += len(text.encode("utf-8"))
    if sum(len(t.encode("utf-8")) for t in entries.values()) > MAX_UNPACKED_BYTES:
        raise RecipeError(f"{shorten(folder)}: its records are past {MAX_UNPACKED_BYTES >> 20} MiB")
    if entries != old:
        write_atomic(bundle, encode(entries))
        if dict(read_bundle(bundle)) != entries:  # what was written is what a reader gets, before any loose file goes
            raise RecipeError(f"{shorten(bundle)}: reads back different from what was packed; no loose file removed")
    for rel in moved:
        (folder / rel).unlink()
    for rel in sorted({Path(r).parent for r in moved if Path(r).parent != Path(".")}, key=lambda p: -len(p.parts)):
        for d in [rel, *rel.parents]:
            if d == Path("."):
                break
            try:
                (folder / d).rmdir()  # only an empty one: anything else left in it stays
            except OSError:
                break
    size = bundle.stat().st_size if entries else 0
    return Packed(folder, len(entries), len(moved), loose_bytes, size)


def unpack(folder: str | Path, to: str | Path) -> list[Path]:
    """Write every file of ``folder``'s bundle (or of the bundle ``folder`` names) under ``to``, and only there:
    the bundle is checked whole first (no ``..``, absolute path or non-record name can be in one), no folder on
    the way may be a link, and a file already there is left when it is the same and refused when it differs;
    nothing is written before every target is checked. Returns the paths written."""
    src = Path(folder)
    bundle = src if src.name == BUNDLE else src / BUNDLE
    entries = read_bundle(bundle)
    to = Path(to)
    if to.is_symlink():
        raise RecipeError(f"{shorten(to)}: is a symbolic link; name the directory itself")
    if to.exists() and not to.is_dir():
        raise RecipeError(f"{shorten(to)}: exists and is not a directory")
    plan = []
    for rel, text in entries.items():
        target = to
        for part in rel.split("/"):
            target = target / part
            if target.is_symlink():
                raise RecipeError(f"{shorten(target)}: is a symbolic link; unpack writes no file through a link")
        for d in list(reversed(target.relative_to(to).parents))[1:]:
            if (to / d).exists() and not (to / d).is_dir():
                raise RecipeError(f"{shorten(to / d)}: exists and is not a directory")
        if target.exists():
            if not _regular(target) or read_loose(target) != text:
                raise RecipeError(f"{shorten(target)}: exists and differs from the bundled file; unpack elsewhere")
            continue
        plan.append((target, text))
    written = []
    to.mkdir(parents=True, exist_ok=True)
    for target, text in plan:
        here = to
        for part in target.relative_to(to).parts[:-1]:
            here = here / part
            if here.is_symlink():
                raise RecipeError(f"{shorten(here)}: is a symbolic link; unpack writes no file through a link")
            here.mkdir(exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        written.append(target)
    return written
