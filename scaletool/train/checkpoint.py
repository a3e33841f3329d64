"""Checkpoints: ``<out>/checkpoints/step_N``, written every ``train.checkpoint_every`` steps.

Each directory holds the engine's native format (``torch.distributed.checkpoint`` for single, DDP
and FSDP; DeepSpeed's ``save_checkpoint`` for deepspeed) plus ``trainer.json`` (step, loss curve),
which rank 0 writes last: a directory without it is an interrupted save and is never resumed from.

:func:`load_model_weights` reads the model weights of any of these formats into a plain
single-device model, for decoding or evaluation.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletool.config import RecipeError

TRAINER_STATE = "trainer.json"
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step}"


def latest_checkpoint(out: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under ``out`` and its trainer state, or None."""
    root = Path(out) / "checkpoints"
    found = []
    for d in root.glob("step_*") if root.is_dir() else ():
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), d))
    if not found:
        return None
    _, d = max(found)
    return d, json.loads((d / TRAINER_STATE).read_text())


def save_checkpoint(engine, out: Path, step: int, trainer_state: dict, is_main: bool) -> Path:
    """Collective: every rank writes its part, then rank 0 marks the directory complete."""
    path = checkpoint_dir(out, step)
    if is_main:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    engine.save(path)
    if dist.is_initialized():
        dist.barrier()
    if is_main:
        tmp = path / (TRAINER_STATE + ".tmp")
        tmp.write_text(json.dumps(trainer_state, indent=2))
        tmp.replace(path / TRAINER_STATE)
    return path


def _canonical(key: str) -> str:
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key


def load_model_weights(ckpt_dir: str | Path, model: nn.Module) -> nn.Module:
    """Load the weights saved in ``ckpt_dir`` (any engine's format) into the plain ``model``.

    DCP checkpoints (single, DDP, FSDP) hold canonical names and fp32 weights; DeepSpeed ones are
    read through DeepSpeed's ``zero_to_fp32`` (ZeRO 1-3, the fp32 master weights) or, without ZeRO
    partitions, from the module state in ``mp_rank_00_model_states.pt``. Weights are cast to the
    model's dtypes. Returns ``model``.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise RecipeError(f"{d}: no such checkpoint directory")
    if (d / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp
        state = {"model": {k: v for k, v in model.state_dict().items()}}
        dcp.load(state, checkpoint_id=str(d), no_dist=True)
        model.load_state_dict(state["model"])
        return model
    if any(d.glob("*mp_rank_00_model_states.pt")):  # ZeRO-3 names it zero_pp_rank_0_mp_rank_00_...
        if any(d.glob("*zero_pp_rank_*optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            sd = get_fp32_state_dict_from_zero_checkpoint(str(d.parent), tag=d.name)
        else:
            sd = torch.load(d / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
        model.load_state_dict({_canonical(k): v for k, v in sd.items()})
        return model
    raise RecipeError(f"{d}: not a scaletool checkpoint (neither torch.distributed.checkpoint's .metadata "
                      "nor DeepSpeed's *mp_rank_00_model_states.pt)")
