"""The results directory's lock: one sweep at a time per directory (and one training run per run directory).

``DIR/.lock`` is ``flock``-ed for as long as a sweep runs there. A sweep takes it exclusively and
writes its pid and host into it; Slurm array tasks of a submitted sweep take it shared (they run side
by side, each appending its own record under the results file's own lock). The kernel releases an
``flock`` when its holder dies, by any signal, so a lock left by a dead sweep is simply taken over: the
file's content only names the last holder, it never decides anything. On NFS, Linux emulates ``flock``
with byte-range locks, which the server arbitrates across nodes.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from scaletool.errors import RecipeError
from scaletool.fmt import open_state, printable, refused

LOCK_FILE = ".lock"


def _holder(path: Path) -> str:
    """``pid N on host H`` from the lock file, as far as it says."""
    try:
        info = json.loads(path.read_text())
        who = f"pid {int(info['pid'])} on host {_one_line(info['host'], 100)}"
        what = _one_line(info.get("what", ""), 200)
        return who + (f" ({what})" if what else "")
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another process (no owner recorded: a Slurm array task of a submitted sweep?)"


def _one_line(value: object, limit: int) -> str:
    """Text from the lock file as one short line (whatever a hostile sweep name put there), its control
    characters escaped: an escape sequence in it is shown, not run by the terminal."""
    return printable(" ".join(str(value).split())[:limit])


@contextlib.contextmanager
def results_lock(results_dir: Path, *, shared: bool = False, what: str = "",
                 advice: str = "write to another results directory (-o)") -> Iterator[None]:
    """Hold the results directory's lock for the duration; a held lock is one RecipeError line naming
    its holder and ending with ``advice``. ``shared``: several holders at once (array tasks), none while
    a sweep holds it. A training run directory is locked the same way (:func:`run_lock`)."""
    path = Path(results_dir) / LOCK_FILE
    try:
        fd = open_state(path, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise RecipeError(f"{path}: {'' if refused(e) else 'cannot open the lock file: '}{e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RecipeError(f"{results_dir}: in use by {_holder(path)}; wait for it to finish, stop it, or "
                              f"{advice}") from None
        if not shared:
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what}) + "\n"
            with contextlib.suppress(OSError):  # the content is informative only; a full disk must not stop us
                os.ftruncate(fd, 0)
                os.pwrite(fd, info.encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def run_lock(out: Path, what: str) -> Iterator[None]:
    """One training run at a time in the run directory ``out`` (created if needed: the lock lives in it).

    A directory this call created and that holds nothing but the lock afterwards (the run was refused
    before it wrote anything) is removed again.
    """
    out = Path(out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"{out}: cannot write the run directory ({e.strerror or e})") from None
    try:
        with results_lock(out, what=what, advice="train into another directory (--out)"):
            yield
    finally:
        if created:
            with contextlib.suppress(OSError):
                if os.listdir(out) == [LOCK_FILE]:
                    (out / LOCK_FILE).unlink()
                    out.rmdir()
