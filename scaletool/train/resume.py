"""Where a run starts: fresh, from a checkpoint, or nowhere (it is finished); decided before anything is written.

- ``Resume.NEVER``: a new run. A run directory that already holds a run (its summary, metric rows
  or checkpoints) is refused rather than overwritten.
- ``Resume.AUTO``: continue from the newest intact checkpoint when there is one, else start at step
  0 (what a restarted worker group needs: ``scaletool launch`` passes it).
- ``Resume.REQUIRED``: continue from the newest intact checkpoint; none is an error, and nothing is
  created in the run directory.

With AUTO or REQUIRED, a run whose ``summary.json`` says it completed at least the requested steps is
finished: nothing runs and its summary stays as it is. With more steps requested, it continues from
its newest checkpoint, and the earlier segment's measurement is kept beside the new one.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from scaletool.errors import RecipeError, shorten
from scaletool.resources import read_bounded
from scaletool.results.base import ResultLoadError
from scaletool.results.train import TrainResult, load_train_summary
from scaletool.train.checkpoint import checkpoint_dirs, newest_intact
from scaletool.train.metrics import METRICS_FILE


class Resume(str, Enum):
    NEVER = "never"
    AUTO = "auto"
    REQUIRED = "required"

    @classmethod
    def parse(cls, value: Resume | str | bool) -> Resume:
        """An explicit choice; ``True``/``False`` mean required/never."""
        if isinstance(value, bool):
            return cls.REQUIRED if value else cls.NEVER
        try:
            return cls(value)
        except ValueError:
            raise RecipeError(f"resume {value!r}: expected one of never, auto, required") from None


@dataclass
class Start:
    """How a run begins: at ``step`` from ``checkpoint`` (None: fresh), or ``finished`` already."""

    step: int = 0
    checkpoint: Path | None = None
    state: dict = field(default_factory=dict)  # the checkpoint's trainer.json
    finished: TrainResult | None = None
    warnings: list[str] = field(default_factory=list)


def previous_summary(out: Path) -> tuple[TrainResult | None, str | None]:
    """The run directory's summary.json as a result, or (None, why it is unusable)."""
    path = Path(out) / "summary.json"
    if not path.is_file():
        return None, None
    try:
        return load_train_summary(json.loads(read_bounded(path, 64 << 20, "a run's summary")), str(path)), None
    except (OSError, ValueError, ResultLoadError, RecursionError) as e:
        return None, f"warning: {path} is unreadable ({str(e).splitlines()[0][:200]}); it will be replaced"


def held_run(out: Path) -> str | None:
    """What in ``out`` belongs to an earlier run (summary, metric rows, checkpoints), or None."""
    out = Path(out)
    held = [name for name in ("summary.json", METRICS_FILE) if (out / name).is_file() and (out / name).stat().st_size]
    if checkpoint_dirs(out):
        held.append("checkpoints")
    return ", ".join(held) or None


#: what a run writes in its directory: files, then folders
OWN_FILES = ("summary.json", METRICS_FILE, "train.log")
OWN_FOLDERS = ("checkpoints", "tensorboard")


def planted(out: Path) -> list[str]:
    """One line for each of the run's own names in ``out`` that is a symbolic link (a resume would write
    ``step_N`` or the summary through it, outside the run directory) or of the wrong kind (a FIFO for
    ``summary.json``, a file for ``checkpoints``): found before any step runs, not after."""
    import stat

    lines = []
    for name, want in [*((n, stat.S_ISREG) for n in OWN_FILES), *((n, stat.S_ISDIR) for n in OWN_FOLDERS)]:
        path = Path(out) / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        except OSError as e:
            lines.append(f"{shorten(str(path))}: cannot be read ({e.strerror or e})")
            continue
        if stat.S_ISLNK(st.st_mode):
            lines.append(f"{shorten(str(path))}: is a symbolic link; scaletool does not write its own files through "
                         "links (remove it)")
        elif not want(st.st_mode):
            kind = "a regular file" if want is stat.S_ISREG else "a directory"
            lines.append(f"{shorten(str(path))}: not {kind}; scaletool writes its own {name} there (remove it)")
    return lines


def plan_start(out: Path, steps: int, resume: Resume) -> Start:
    """Decide where the run in ``out`` starts (rank 0 decides; see :func:`scaletool.engines.agree`). The run's
    own names in ``out`` are checked first (:func:`planted`): nothing is trained that could not be recorded."""
    out = Path(out)
    problems = planted(out)
    if problems:
        raise RecipeError(problems)
    if resume is Resume.NEVER:
        held = held_run(out)
        if held:
            raise RecipeError(f"{out}: already holds a training run ({held}); resume it, or train into another "
                              "directory")
        return Start()
    prev, unreadable = previous_summary(out)
    if prev is not None and prev.status == "completed" and prev.steps_completed >= steps:
        return Start(step=prev.steps_completed, finished=prev)
    found, warnings = newest_intact(out)
    warnings += [unreadable] if unreadable else []
    if found is not None:
        path, state = found
        return Start(step=int(state["step"]), checkpoint=path, state=state, warnings=warnings)
    if resume is Resume.REQUIRED:
        raise RecipeError(f"no complete checkpoint to resume from under {out / 'checkpoints'}")
    if prev is not None and prev.status == "completed":
        raise RecipeError(f"{out}: holds a finished {prev.steps_completed}-step run without a checkpoint to continue "
                          "from; train into another directory")
    return Start(warnings=warnings)


def load_checkpoint(engine, path: Path) -> None:
    """``engine.load(path)`` for a checkpoint that verified; what its files hold beyond what verification
    reads (a tensor's bytes, the optimizer's layout) may still be wrong: one line naming the checkpoint."""
    import torch

    try:
        engine.load(path)
    except RecipeError:
        raise
    except (torch.OutOfMemoryError, torch.distributed.DistError):  # the machine or a peer, not the files
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError, EOFError, RuntimeError,
            pickle.UnpicklingError) as e:
        said = (str(e).strip().splitlines() or [""])[0][:150]
        raise RecipeError(f"{path}: cannot be loaded ({type(e).__name__}: {said})") from None
