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

import torch.distributed as dist
import torch.nn as nn

from scaletool.engines import DistEnv
from scaletool.engines.serialization import (
    UnsafeCheckpointError,
    dcp_load,
    dcp_problem,
    dcp_shapes,
    load_pt,
    shape_problem,
)
from scaletool.errors import RecipeError

TRAINER_STATE = "trainer.json"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step_(\d+)")
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")
# DeepSpeed's model states: mp_rank_00_model_states.pt (ZeRO 0-2), zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)
_DS_STATES = "mp_rank_00_model_states.pt"
_DS_ZERO3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


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


def _trainer_state(d: Path, step: int) -> tuple[dict | None, str | None]:
    try:
        state = json.loads((d / TRAINER_STATE).read_text())
    except FileNotFoundError:
        return None, f"no {TRAINER_STATE}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{TRAINER_STATE} is unreadable ({type(e).__name__}: {str(e)[:100]})"
    if not isinstance(state, dict) or state.get("step") != step or not isinstance(state.get("history"), dict):
        return None, f"{TRAINER_STATE} does not describe step {step}"
    return state, None


def _format_problem(d: Path) -> str | None:
    if (d / ".metadata").is_file() or not any(d.glob(f"*{_DS_STATES}")):
        return dcp_problem(d)
    for f in d.glob("*.pt"):
        if not zipfile.is_zipfile(f):  # torch.save's zip format ends with its directory: a cut file has none
            return f"{f.name} is not a complete torch.save file (a half-written file)"
    return None


def verify(d: Path) -> tuple[dict | None, str | None]:
    """(trainer state, None) for an intact checkpoint directory, else (None, why it cannot be used)."""
    m = _STEP_DIR.fullmatch(d.name)
    step = int(m.group(1)) if m else -1
    marker = d / MARKER
    if marker.is_file():
        try:
            listed = json.loads(marker.read_text())["files"]
            listed = {str(k): int(v) for k, v in listed.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return None, f"its {MARKER} marker is unreadable ({type(e).__name__})"
        actual = _manifest(d)
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
        first_problem = first_problem or f"{d}: {problem}"
        warnings.append(f"warning: skipping checkpoint {d}: {problem}")
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


def load_model_weights(ckpt_dir: str | Path, model: nn.Module, *, trust_checkpoint: bool = False) -> nn.Module:
    """Load the weights saved in ``ckpt_dir`` (any engine's format) into the plain ``model``; return it.

    DCP checkpoints (single, DDP, FSDP) hold canonical names and fp32 weights. DeepSpeed ZeRO 0-2
    checkpoints hold the whole module in ``mp_rank_00_model_states.pt`` (the weights the engine
    computes with). Every file is read as plain data (no code runs); a file that needs more is
    refused. ZeRO-3 partitions the weights, and the only reader that gathers them (DeepSpeed's
    ``zero_to_fp32``) unpickles without restriction: it runs only with ``trust_checkpoint=True``.
    A checkpoint whose tensor shapes differ from ``model``'s fails with one line naming the first.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise RecipeError(f"{d}: no such checkpoint directory")
    if (d / MARKER).is_file():  # one of ours: the files as they were written
        _, problem = verify(d)
        if problem is not None:
            raise RecipeError(f"{d}: {problem}")
    if (d / ".metadata").is_file():
        problem = dcp_problem(d)
        if problem is not None:
            raise RecipeError(f"{d}: {problem}")
        mismatch = shape_problem(d, dcp_shapes(d), _shapes(model))
        if mismatch:
            raise RecipeError(mismatch)
        state = {"model": dict(model.state_dict())}
        dcp_load(state, d, no_dist=True)
        model.load_state_dict(state["model"])
        return model
    if (d / _DS_ZERO3_STATES).is_file():
        if not trust_checkpoint:
            raise UnsafeCheckpointError(
                f"{d}: a DeepSpeed ZeRO-3 checkpoint: its weights are partitioned, and DeepSpeed's zero_to_fp32, "
                "which gathers them, unpickles the files without restriction (loading could run code). Load it "
                "only from a source you trust (trust_checkpoint).")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        sd = get_fp32_state_dict_from_zero_checkpoint(str(d.parent), tag=d.name)
    elif (d / _DS_STATES).is_file():
        sd = load_pt(d / _DS_STATES, trust=trust_checkpoint, deepspeed=True)["module"]
    else:
        raise RecipeError(f"{d}: not a scaletool checkpoint (neither torch.distributed.checkpoint's .metadata "
                          f"nor DeepSpeed's *{_DS_STATES})")
    sd = {_canonical(k): v for k, v in sd.items()}
    mismatch = shape_problem(d, {k: tuple(v.shape) for k, v in sd.items()}, _shapes(model))
    if mismatch:
        raise RecipeError(mismatch)
    model.load_state_dict(sd)
    return model
