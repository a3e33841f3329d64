"""Files that ship inside the package: model recipes, sweep files, accelerator profiles and the documentation.

The repository's top-level ``recipes/``, ``profiles/`` and ``docs/`` are the source. The package sees them through
symbolic links, ``scaletool/recipes -> ../recipes``, ``scaletool/profiles -> ../profiles`` and
``scaletool/docs -> ../docs`` (its ``*.md`` pages, what ``scaletool docs`` prints): a
checkout on ``sys.path``, an editable install and a wheel (whose build copies the linked files in, see
``package-data`` in pyproject.toml; ``benchmarks`` stays out) all read them at the same place
with :mod:`importlib.resources`. (A ``package-dir`` mapping of ``scaletool.recipes`` to ``recipes`` was
the alternative; it needs every package listed by hand, an ``__init__.py`` in each data folder for
setuptools' editable finder, and still nothing for a plain checkout.)

:func:`find_recipe` is the one lookup every command that reads a recipe or sweep file goes through:
a path that exists is used as given; otherwise a shipped name (``llama3-8b``, ``llama3-8b.yaml``,
``recipes/llama3-8b.yaml``, ``mla-compression``) resolves to the shipped file.
"""
from __future__ import annotations

import difflib
import importlib.resources
import re
from pathlib import Path

from scaletool.errors import RecipeError, shorten

RECIPE, SWEEP = "recipe", "sweep"
# A sweep file names its base recipe at the top level; a model recipe has only sections (model, train, ...).
_SWEEP_KEY = re.compile(r"^recipe\s*:", re.M)


def data_dir(name: str) -> Path:
    """The shipped folder ``name`` (``recipes``, ``profiles`` or ``docs``) as a directory on disk."""
    root = importlib.resources.files("scaletool") / name
    if not isinstance(root, Path) or not root.is_dir():
        # a zipped install (zipimport): scaletool writes run directories beside its inputs, so it needs files
        raise RecipeError(f"scaletool's shipped {name}/ folder is missing from {root} (an incomplete or zipped "
                          "install); reinstall scaletool with pip")
    return root


def shipped(kind: str) -> dict[str, Path]:
    """Shipped files of ``kind`` (:data:`RECIPE` or :data:`SWEEP`) by name, sorted by name.

    Sweep files live in ``recipes/sweeps/``, plus those among ``recipes/*.yaml`` (the quickstart's)."""
    root = data_dir("recipes")
    top = {p.stem: p for p in root.glob("*.yaml")}
    is_sweep = {name for name, p in top.items() if _SWEEP_KEY.search(p.read_text())}
    if kind == RECIPE:
        found = {n: p for n, p in top.items() if n not in is_sweep}
    elif kind == SWEEP:
        found = {**{n: top[n] for n in is_sweep}, **{p.stem: p for p in (root / "sweeps").glob("*.yaml")}}
    else:
        raise ValueError(f"kind must be {RECIPE!r} or {SWEEP!r}, got {kind!r}")
    return dict(sorted(found.items()))


def _shipped_name(arg: str) -> str | None:
    """The name a shipped-file argument stands for: ``NAME``, ``NAME.yaml``, ``recipes/NAME.yaml``,
    ``recipes/sweeps/NAME.yaml`` (the repository's own paths, so README's commands work anywhere)."""
    p = Path(arg)
    if p.is_absolute() or p.parts[:-1] not in ((), ("recipes",), ("sweeps",), ("recipes", "sweeps")):
        return None
    return p.stem if p.suffix in (".yaml", ".yml") else p.name


def find_recipe(arg: str | Path, kind: str = RECIPE) -> Path:
    """The file ``arg`` names: itself when it exists, else the shipped recipe (or sweep) of that name.

    A shipped file of the other kind is returned too (its loader then says what it is); a name that is
    neither gives one line with the closest shipped name and all of them."""
    path = Path(arg)
    try:
        if path.exists():
            return path
    except OSError as e:  # a name too long for the filesystem, say
        raise RecipeError(f"{shorten(arg)}: cannot read: {e.strerror or e}") from None
    name = _shipped_name(str(arg))
    if name is None:
        raise RecipeError(f"{shorten(arg)}: no such file")
    other = SWEEP if kind == RECIPE else RECIPE
    mine, theirs = shipped(kind), shipped(other)
    if name in mine or name in theirs:
        return mine.get(name) or theirs[name]
    close = difflib.get_close_matches(name, [*mine, *theirs], n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise RecipeError(f"{shorten(arg)}: no such file, nor a shipped {kind}; {hint}shipped {kind}s: {', '.join(mine)}")


def doc_pages() -> dict[str, Path]:
    """The shipped documentation pages (``docs/*.md``) by topic (the file's stem), sorted by topic."""
    return {p.stem: p for p in sorted(data_dir("docs").glob("*.md"))}


def doc_page(topic: str) -> Path:
    """The page of ``topic`` (``plan``, ``plan.md`` or ``docs/plan.md``); an unknown one is one line naming the
    closest topic and all of them."""
    pages = doc_pages()
    name = Path(topic).stem if Path(topic).parts[:-1] in ((), ("docs",)) else topic
    if name in pages:
        return pages[name]
    close = difflib.get_close_matches(name, list(pages), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise RecipeError(f"{shorten(topic)}: no such documentation page; {hint}topics: {', '.join(pages)}")


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refused (one RecipeError line) when it is missing, not a
    regular file (a directory, FIFO or device such as /dev/zero would block or never end), unreadable or
    larger than ``limit`` bytes (``what`` names what such a file normally is, for the message).

    The file is opened without blocking (a FIFO put in its place after a check never waits for a writer)
    and its type is checked on the open descriptor, so what is read is what was checked."""
    import os
    import stat

    p = Path(path)
    shown = shorten(p)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RecipeError(f"{shown}: no such file") from None
    except OSError as e:
        raise RecipeError(f"{shown}: cannot read: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RecipeError(f"{shown}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            blob = f.read(limit + 1)
    except OSError as e:
        raise RecipeError(f"{shown}: cannot read: {e.strerror or e}") from None
    if len(blob) > limit:
        size = f"{limit // 2**20} MiB" if limit >= 2**20 and limit % 2**20 == 0 else f"{limit // 1024} KiB"
        raise RecipeError(f"{shown}: larger than {size}; {what} is a few KiB")
    return blob
