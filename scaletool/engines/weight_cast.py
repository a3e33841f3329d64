"""``train.weight_cast=step``: one 16-bit copy of each linear weight per optimizer step, not per micro-batch.

Under autocast every ``nn.Linear`` casts its fp32 weight to 16 bits at each forward (inside a compiled
graph too), and the backward casts the 16-bit weight gradient back to fp32 before it is added into
``.grad``. With gradient accumulation that is ``grad_accum_steps`` casts of every weight each way per
optimizer step. Here each linear layer instead reads a persistent 16-bit leaf tensor (``weight16``),
refreshed from the fp32 weight once per optimizer step (after the step, and after a checkpoint load);
a hook on the leaf adds each micro-batch's 16-bit gradient into the fp32 ``.grad`` in one kernel and
drops it. The numbers are autocast's: the forward multiplies by the same rounded weight, and the fp32
gradient is the same sum of the same fp32-converted terms in the same order.

Plain ``nn.Linear`` modules are taken (FP8's ``Float8Linear`` and a tied LM head keep autocast's
casts), only where autocast is on at the call (a forward under ``autocast(enabled=False)`` reads the
fp32 weight as before); so are a dropless MoE layer's stacked experts: one 16-bit w1|w3 (E, d, 2i),
the operand of its fused gate/up grouped GEMM, and w2, each gradient split back into its fp32 parts.
One device only: DDP's and FSDP2's gradient hooks sit on the parameters, which this path no longer
accumulates through autograd.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletool.kernels import split_add


class CastOnceLinear(nn.Linear):
    """``nn.Linear`` whose forward under autocast multiplies by ``weight16`` (set by :func:`attach`).
    The class of an existing module is swapped in place: parameters, names and state dict unchanged."""

    weight16: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight16
        if w is not None and torch.is_autocast_enabled(x.device.type):
            return F.linear(x, w, self.bias)
        return F.linear(x, self.weight, self.bias)


class WeightCasts:
    """The 16-bit copies :func:`attach` made: ``refresh()`` after every change of the fp32 weights."""

    def __init__(self, pairs: list[tuple[nn.Parameter, torch.Tensor]], experts: int = 0):
        self.pairs = pairs
        self.experts = experts  # how many of the pairs are MoE experts' stacked weights (the last ones)

    @property
    def params(self) -> int:
        return sum(p.numel() for p, _ in self.pairs)

    @property
    def bytes(self) -> int:
        return sum(w.numel() * w.element_size() for _, w in self.pairs)

    @torch.no_grad()
    def refresh(self) -> None:
        if self.pairs:
            torch._foreach_copy_([w for _, w in self.pairs], [p for p, _ in self.pairs])  # cast as it copies


def _add_grad(param: nn.Parameter, g: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = g.to(param.dtype, memory_format=torch.contiguous_format)
    else:
        param.grad.add_(g)  # fp32 += 16-bit, converted in the same kernel


def _accumulate(param: nn.Parameter):
    def hook(w16: torch.Tensor) -> None:
        _add_grad(param, w16.grad)
        w16.grad = None
    return hook


def _accumulate_split(params: list[nn.Parameter], dim: int):
    """The hook of a copy that concatenates ``params`` along ``dim``: each gets its slice of the gradient
    (two halves of the last dimension on CUDA in one pass: :mod:`scaletool.kernels.split_add`)."""
    def hook(w16: torch.Tensor) -> None:
        grads = [p.grad for p in params]
        if dim in (-1, w16.dim() - 1) and split_add.supports(grads, w16.grad) is None:
            for p, g in zip(params, split_add.split_add_(grads, w16.grad)):
                p.grad = g  # the same tensor when it existed; set on the first micro-batch
        else:
            for p, g in zip(params, w16.grad.split([p.shape[dim] for p in params], dim)):
                _add_grad(p, g)
        w16.grad = None
    return hook


@torch.no_grad()
def _attach_experts(model: nn.Module, dtype: torch.dtype) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Persistent 16-bit copies for every dropless MoE layer's experts (module docstring); the pairs refresh
    copies into (views of) them."""
    from scaletool.model.moe import MoE

    pairs = []
    for moe in (m for m in model.modules() if isinstance(m, MoE) and m.cfg.moe_dispatch == "dropless"):
        ex = moe.experts
        if ex.w1.dtype == dtype or ex.weights16 is not None:
            continue
        w13 = torch.cat([ex.w1, ex.w3], -1).to(dtype)
        w2 = ex.w2.to(dtype)
        i = ex.w1.shape[-1]
        pairs += [(ex.w1, w13[..., :i]), (ex.w3, w13[..., i:]), (ex.w2, w2)]
        if ex.w1.requires_grad:
            w13.requires_grad_(True).register_post_accumulate_grad_hook(_accumulate_split([ex.w1, ex.w3], -1))
            w2.requires_grad_(True).register_post_accumulate_grad_hook(_accumulate(ex.w2))
        ex.weights16 = (w13, w2)
    return pairs


def attach(model: nn.Module, dtype: torch.dtype) -> WeightCasts:
    """Give every plain ``nn.Linear`` of ``model`` a ``dtype`` copy of its weight, read under autocast, and
    every dropless MoE layer's experts theirs."""
    pairs: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype == dtype:
            continue
        p = module.weight
        if id(p) not in pairs:
            w16 = p.detach().to(dtype).requires_grad_(p.requires_grad)
            if p.requires_grad:
                w16.register_post_accumulate_grad_hook(_accumulate(p))
            pairs[id(p)] = (p, w16)
        module.__class__ = CastOnceLinear
        module.weight16 = pairs[id(p)][1]
    experts = _attach_experts(model, dtype)
    return WeightCasts([*pairs.values(), *experts], experts=len(experts))
