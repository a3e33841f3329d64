"""Checkpoints: ``<out>/checkpoints/step_N``, written atomically and verified before use.

A save writes into ``checkpoints/.step_N.partial``: every rank its part in the engine's native format
(``torch.distributed.checkpoint`` for single, DDP and FSDP; DeepSpeed's ``save_checkpoint`` for
deepspeed), then rank 0 writes ``trainer.json`` (step, loss curve, segments) and, last, the
completion marker ``COMPLETE`` (a manifest: every file with its size), and renames the directory to
``step_N``. A process killed mid-save leaves only the ``.partial`` directory, which is never resumed
from (and is replaced by the next save).

Before a resume, :func:`newest_intact` verifies the newest checkpoint: the marker and the
files and sizes it lists, ``trainer.json``, the format's own metadata (DCP's ``.metadata``, read
without running code, and the data files it points into; DeepSpeed's model-state file). A damaged
one is skipped with a warning naming it, and the next older one is used. Checkpoints written before
the marker existed (``trainer.json`` last) are verified without it.

:func:`load_model_weights` reads the model weights of any of these formats into a plain
single-device model, for decoding or evaluation, without unpickling code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletool.engines import DistEnv
from scaletool.engines.checkpoint_files import model_states_problem
from scaletool.engines.serialization import (
    DEEPSPEED_GLOBALS,
    NOT_ARCHIVE,
    UnsafeCheckpointError,
    dcp_load,
    dcp_problem,
    dcp_shapes,
    load_model_states,
    load_pt,
    shape_problem,
    unsafe_globals,
)
from scaletool.errors import RecipeError, shorten
from scaletool.train.trainer_state import trainer_state_problem

TRAINER_STATE = "trainer.json"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step_(\d+)")
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")
# DeepSpeed's model states: mp_rank_00_model_states.pt (ZeRO 0-2), zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)
_DS_STATES = "mp_rank_00_model_states.pt"
_DS_ZERO3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_MAX_STEP = 2**63 - 1  # steps are int64 wherever torch or a logger meets them


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step}"


def checkpoint_dirs(out: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` directory under ``out/checkpoints``, newest first (complete or not)."""
    root = Path(out) / "checkpoints"
    found = []
    for d in root.iterdir() if root.is_dir() else ():
        m = _STEP_DIR.fullmatch(d.name)
        if m and d.is_dir():
            found.append((int(m.group(1)), d))
    return sorted(found, reverse=True)


def _manifest(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file() and p.name != MARKER}


def _trainer_state(d: Path, step: int | None) -> tuple[dict | None, str | None]:
    try:
        state = json.loads((d / TRAINER_STATE).read_text())
    except FileNotFoundError:
        return None, f"no {TRAINER_STATE}"
    except IsADirectoryError:
        return None, f"{TRAINER_STATE} is a directory, not a file"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"{TRAINER_STATE} is unreadable ({type(e).__name__}: {str(e)[:100]})"
    problem = trainer_state_problem(state, step)
    if problem is not None:
        return None, f"{TRAINER_STATE} {problem}"
    return state, None


def _format_problem(d: Path) -> str | None:
    """Why the engine's files in ``d`` cannot be loaded: DCP's metadata and data files, or every DeepSpeed
    ``.pt`` file readable as plain data (memory-mapped: the tensors are not read) and the model states
    shaped as DeepSpeed writes them."""
    if (d / ".metadata").exists() or not any(d.glob(f"*{_DS_STATES}")):
        return dcp_problem(d)
    for f in sorted(d.glob("*.pt")):
        if not f.is_file():
            return f"{f.name}: {'a directory where a file is expected' if f.is_dir() else 'not a regular file'}"
        if not zipfile.is_zipfile(f):  # torch.save's zip format ends with its directory: a cut file has none
            return f"{f.name}: {NOT_ARCHIVE}"
        try:  # the pickle's names, then (DeepSpeed not imported yet: the engine picks its accelerator) plain data
            needed = unsafe_globals(f)
            unsafe = [n for n in needed if n not in DEEPSPEED_GLOBALS]
            if unsafe:
                return (f"{f.name}: refused: the file holds Python objects beyond tensors and plain data (it needs "
                        f"{unsafe[0][:200]}); loading it could run code")
            obj = None if needed else load_pt(f, mmap=True)
        except RecipeError as e:
            return f"{f.name}: {str(e).removeprefix(f'{f}: ')}"
        if obj is None:
            continue
        problem = model_states_problem(obj) if f.name.endswith(_DS_STATES) else (
            None if isinstance(obj, dict) else f"it holds {type(obj).__name__}, not DeepSpeed's state mapping")
        if problem is not None:
            return f"{f.name}: not the states DeepSpeed writes: {problem}"
    return None


def verify(d: Path) -> tuple[dict | None, str | None]:
    """(trainer state, None) for an intact checkpoint directory, else (None, why it cannot be used)."""
    m = _STEP_DIR.fullmatch(d.name)
    step = int(m.group(1)) if m else None  # None: a directory renamed by hand (decode reads any)
    if step is not None and step > _MAX_STEP:
        return None, f"its step number is beyond {_MAX_STEP} (not a checkpoint scaletool wrote)"
    marker = d / MARKER
    if marker.is_file():
        try:
            listed = json.loads(marker.read_text())["files"]
            listed = {str(k): int(v) for k, v in listed.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            return None, f"its {MARKER} marker is unreadable ({type(e).__name__})"
        try:
            actual = _manifest(d)
        except OSError as e:
            return None, f"cannot list its files ({e.strerror or e})"
        for name, size in sorted(listed.items()):
            if name not in actual:
                return None, f"{name} is missing"
            if actual[name] != size:
                return None, f"{name} is {actual[name]} bytes, {size} when it was written"
    elif not (d / TRAINER_STATE).is_file():
        return None, f"no {MARKER} marker (an interrupted save)"
    state, problem = _trainer_state(d, step)
    return (state, None) if problem is None else (None, problem)


def newest_intact(out: Path) -> tuple[tuple[Path, dict] | None, list[str]]:
    """The newest checkpoint under ``out`` that verifies, with its trainer state (None when there is no
    checkpoint at all), and one warning per newer one skipped. When every checkpoint fails
    verification: a RecipeError naming the newest and why."""
    warnings, first_problem = [], None
    for _, d in checkpoint_dirs(out):
        state, problem = verify(d)
        if problem is None:
            problem = _format_problem(d)
        if problem is None:
            return (d, state), warnings
        first_problem = first_problem or f"{shorten(str(d))}: {problem}"
        warnings.append(f"warning: skipping checkpoint {shorten(str(d))}: {problem}")
    if first_problem is not None:
        raise RecipeError(f"no intact checkpoint to resume from; the newest, {first_problem}")
    return None, warnings


class Checkpointer:
    """Saves the checkpoints of one run directory (a collective: every rank calls :meth:`save`)."""

    def __init__(self, out: Path, env: DistEnv):
        self.out, self.env = Path(out), env

    def _barrier(self) -> None:
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()

    def save(self, engine, step: int, trainer_state: dict) -> Path:
        """Collective: every rank writes its part into a temporary directory; rank 0 completes it."""
        final = checkpoint_dir(self.out, step)
        tmp = final.with_name(f".{final.name}.partial")
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
            tmp.mkdir(parents=True)
        self._barrier()
        engine.save(tmp)
        self._barrier()
        if self.env.is_main:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
            (tmp / MARKER).write_text(json.dumps({"step": step, "files": _manifest(tmp)}, indent=1))
            old = final.with_name(f".{final.name}.replaced")
            if final.exists():  # the same step saved again after a resume from an earlier one
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return final



def _canonical(key: str) -> str:
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_loadable(ckpt_dir: str | Path, *, trust_checkpoint: bool = False) -> None:
    """Refuse, with one line, a checkpoint directory whose weights :func:`load_model_weights` could not read:
    its marker's manifest and ``trainer.json`` when it has them, then the format's files (without
    reading the tensors). Cheap enough to run before a model is built."""
    d = Path(ckpt_dir)
    where = shorten(str(d))  # a step number of 250 digits stays one readable line
    if not d.is_dir():
        raise RecipeError(f"{where}: {'not a directory' if d.exists() else 'no such checkpoint directory'}")
    if (d / MARKER).exists():  # one of ours: the files as they were written
        _, problem = verify(d)
        if problem is not None:
            raise RecipeError(f"{where}: {problem}")
    if (d / ".metadata").exists():
        problem = dcp_problem(d)
        if problem is not None:
            raise RecipeError(f"{where}: {problem}")
    elif (d / _DS_ZERO3_STATES).exists():
        if not trust_checkpoint:
            raise UnsafeCheckpointError(
                f"{where}: a DeepSpeed ZeRO-3 checkpoint: its weights are partitioned, and DeepSpeed's zero_to_fp32, "
                "which gathers them, unpickles the files without restriction (loading could run code). Load it "
                "only from a source you trust (trust_checkpoint).")
    elif (d / _DS_STATES).exists():
        load_model_states(d / _DS_STATES, trust=trust_checkpoint, mmap=True)
    else:
        raise RecipeError(f"{where}: not a scaletool checkpoint (neither torch.distributed.checkpoint's .metadata "
                          f"nor DeepSpeed's *{_DS_STATES})")


def load_model_weights(ckpt_dir: str | Path, model: nn.Module, *, trust_checkpoint: bool = False) -> nn.Module:
    """Load the weights saved in ``ckpt_dir`` (any engine's format) into the plain ``model``; return it.

    DCP checkpoints (single, DDP, FSDP) hold canonical names and fp32 weights. DeepSpeed ZeRO 0-2
    checkpoints hold the whole module in ``mp_rank_00_model_states.pt`` (the weights the engine
    computes with). Every file is read as plain data (no code runs); a file that needs more is
    refused. ZeRO-3 partitions the weights, and the only reader that gathers them (DeepSpeed's
    ``zero_to_fp32``) unpickles without restriction: it runs only with ``trust_checkpoint=True``.
    A damaged checkpoint, or one whose tensor shapes differ from ``model``'s, fails with one line.
    """
    d = Path(ckpt_dir)
    check_loadable(d, trust_checkpoint=trust_checkpoint)
    if (d / ".metadata").exists():
        mismatch = shape_problem(d, dcp_shapes(d), _shapes(model))
        if mismatch:
            raise RecipeError(mismatch)
        state = {"model": dict(model.state_dict())}
        dcp_load(state, d, no_dist=True)
        model.load_state_dict(state["model"])
        return model
    if (d / _DS_ZERO3_STATES).exists():
        from scaletool.engines.deepspeed_import import quiet_deepspeed

        with quiet_deepspeed():
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        try:
            with quiet_deepspeed():
                sd = get_fp32_state_dict_from_zero_checkpoint(str(d.parent), tag=d.name)
        except Exception as e:  # a trusted checkpoint that DeepSpeed's own reader cannot gather
            raise RecipeError(f"{d}: DeepSpeed's zero_to_fp32 cannot read it ({type(e).__name__}: "
                              f"{(str(e).strip().splitlines() or [''])[0][:150]})") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise RecipeError(f"{d}: DeepSpeed's zero_to_fp32 did not return a mapping of tensors")
    else:
        sd = load_model_states(d / _DS_STATES, trust=trust_checkpoint, mmap=True)["module"]
    sd = {_canonical(k): v for k, v in sd.items()}
    mismatch = shape_problem(d, {k: tuple(v.shape) for k, v in sd.items()}, _shapes(model))
    if mismatch:
        raise RecipeError(mismatch)
    model.load_state_dict(sd)
    return model
