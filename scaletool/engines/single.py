"""One device: the reference engine, and the base that DDP and FSDP specialise.

Mixed precision is ``torch.autocast`` over fp32 master weights (bf16 or fp16; fp16 adds a
``GradScaler``); FSDP replaces autocast with its mixed-precision policy. Checkpoints go through
``torch.distributed.checkpoint`` with ``get_state_dict``/``set_state_dict``, whose canonical
parameter names do not depend on the wrapping (DDP, FSDP, compile, activation checkpointing).
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from scaletool.config import Recipe, RecipeError
from scaletool.engines import float8, weight_cast
from scaletool.engines.apply import apply_activation_checkpointing, compile_blocks, compile_kwargs
from scaletool.engines.base import Engine
from scaletool.engines.dist import DistEnv
from scaletool.engines.optim import make_adamw
from scaletool.engines.serialization import dcp_load, dcp_shapes, shape_problem, single_process_intended
from scaletool.kinds.engines import SINGLE, engine_kind
from scaletool.model.layers import TORCH_DTYPES as DTYPES


class SingleEngine(Engine):
    name = "single"
    #: True where the wrapper casts parameters itself (FSDP's MixedPrecisionPolicy), so no autocast
    casts_params = False

    def __init__(self, model: nn.Module, recipe: Recipe, env: DistEnv):
        self.recipe, self.env = recipe, env
        t = recipe.train
        self.grad_clip = t.grad_clip
        self.shard_tensors(model)
        #: train.float8: the linear layers swapped to torchao's Float8Linear and those kept in bf16
        self.float8 = float8.convert(model, recipe) if t.float8 != "none" else None
        #: train.weight_cast=step: the linear layers' 16-bit weight copies, kept for a whole optimizer step
        self.weight_casts = weight_cast.attach(model, DTYPES[recipe.model.dtype]) if t.weight_cast == "step" else None
        apply_activation_checkpointing(model, t)
        if t.compile:
            scope = t.compile_scope if t.compile_scope != "auto" else engine_kind(recipe.parallel.engine).auto_compile_scope
            if scope == "model":
                model.compile(**compile_kwargs(t))  # in place: parameter names unchanged
            else:
                compile_blocks(model, t)
        self.cudagraphs = t.compile and t.compile_mode == "reduce-overhead"
        self.model = self.wrap(model)
        self.optimizer = make_adamw(self.model, t, env.device)
        dtype = recipe.model.dtype
        self.compute_dtype = DTYPES[dtype]
        mixed = dtype != "fp32" and not self.casts_params
        self.autocast = (lambda: torch.autocast(env.device.type, dtype=self.compute_dtype)) if mixed else nullcontext
        self.scaler = torch.amp.GradScaler(env.device.type) if dtype == "fp16" else None
        # clip inside the fused AdamW kernel where params are plain tensors (not FSDP's DTensors)
        # and no GradScaler owns the optimizer's grad_scale
        self.clip_in_optimizer = bool(self.optimizer.defaults.get("fused")) and not self.casts_params \
            and self.scaler is None

    def shard_tensors(self, model: nn.Module) -> None:
        """Split layers across ranks in place, before checkpointing and compile wrap them (FSDP: tensor
        parallelism); nothing here."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as the loop calls it; DDP and FSDP override."""
        return model

    def grad_sync(self, enabled: bool):
        """Context for one micro-step's forward and backward; ``enabled=False`` while accumulating."""
        return nullcontext()

    def finish_grads(self) -> None:
        """After the last micro-batch's backward, before clipping: what the gradients still need (FSDP's
        pure tensor parallelism reduces partial sums here); nothing on one device."""

    def train_step(self, batches, lr):
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        n = len(batches)
        total = None
        for i, (inputs, targets) in enumerate(batches):
            if self.cudagraphs:  # a new iteration: CUDA graph trees may reuse the last one's output memory
                torch.compiler.cudagraph_mark_step_begin()
            with self.grad_sync(i == n - 1):
                with self.autocast():
                    loss = self.model(inputs, targets)
                scaled = loss / n
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss = _plain(loss.detach())
            total = loss if total is None else total + loss
        self.finish_grads()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.grad_clip > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            groups = _by_mesh(params)
            norm = _total_norm(groups)
            if self.clip_in_optimizer:
                # fused AdamW divides every gradient by ``grad_scale`` inside its kernel (the hook
                # GradScaler uses): clipping by norm/max_norm there saves a read and write of all grads
                self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0)
            else:
                for group in groups:
                    nn.utils.clip_grads_with_norm_(group, self.grad_clip, norm, foreach=True)
            norm = _plain(norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.float8 is not None:
            float8.after_optimizer_step(self.model, self.recipe)
        if self.weight_casts is not None:
            self.weight_casts.refresh()
        self.optimizer.zero_grad(set_to_none=True)
        return total / n, norm

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save(self, path: Path) -> None:
        with single_process_intended():
            dcp.save(self._state(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        state = self._state()
        model_shapes = {k: tuple(v.shape) for k, v in state["model"].items()}  # global shapes (DTensors too)
        mismatch = shape_problem(path, dcp_shapes(path), model_shapes)
        if mismatch:
            raise RecipeError(mismatch)
        dcp_load(state, path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.weight_casts is not None:
            self.weight_casts.refresh()
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])


def _by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped by the DeviceMesh of their DTensor (None for plain tensors), in first-seen order:
    foreach kernels and ``torch.stack`` take DTensors of one mesh at a time (expert parallelism over groups
    smaller than the data-parallel ranks puts the experts on a mesh of their own)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(groups.values())


def _total_norm(groups: list[list[nn.Parameter]]) -> torch.Tensor:
    """The 2-norm of every group's gradients together: one foreach norm per group, a group's DTensor norm made
    whole over its mesh before they are combined (one group: the norm as ``get_total_norm`` returns it)."""
    norms = [nn.utils.get_total_norm([p.grad for p in g], foreach=True) for g in groups]
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([_plain(n) for n in norms]))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the whole value: FSDP2's gradient norm and a tensor-parallel loss are DTensors."""
    return t.full_tensor() if isinstance(t, DTensor) else t


SINGLE.provide(constructor=SingleEngine)
