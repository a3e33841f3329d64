"""``parallel.tp_local_ops``: the same tensor-parallel split as :mod:`scaletool.engines.tp`, with every
op inside a block run on plain (local) tensors instead of DTensors.

Under DTensor each op of a block (every linear's ``t``/``mm``/``view``, each norm's ``pow``/``mean``/
``rsqrt``/``mul``, residual adds, and their backward ops) goes through DTensor's dispatch: sharding
propagation and unwrap/rewrap on the host, on top of the local op. At 1B parameters a TP step is bound by
that host time. Here the parameters stay DTensors with the plan's placements (FSDP2, the optimizer and
checkpoints see what they see under the DTensor plan), but a block converts each parameter to its local
shard once per use (``to_local``, whose gradient comes back with the parameter's placement, or
``Partial`` for a replicated one whose per-rank gradient is a partial sum) and runs the module's math
with ``torch.nn.functional``. Communication is the DTensor plan's, written out at the region edges:
the sequence-sharded input all-gathered at the entry of attention and FFN (its gradient a partial sum,
reduce-scattered), the row-parallel output's partial sums reduce-scattered onto the sequence shards
(its gradient all-gathered). Between blocks the residual stream stays a ``Shard(1)`` DTensor, so the
model code sees global shapes; the embedding, final norm and head keep the DTensor plan.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

_PARTIAL = (Partial(),)
_SEQ = (Shard(1),)
_REPLICATE = (Replicate(),)


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The local sequence shard -> the whole sequence (all-gather); backward: partial sums reduce-scattered."""
    whole = DTensor.from_local(x, mesh, _SEQ, run_check=False).redistribute(placements=_REPLICATE)
    return whole.to_local(grad_placements=_PARTIAL)


def _scatter_sequence(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's partial sums -> its sequence shard of their total (reduce-scatter); backward: all-gather."""
    return DTensor.from_local(y, mesh, _PARTIAL, run_check=False).redistribute(placements=_SEQ).to_local()


def _distribute(module: nn.Module, mesh: DeviceMesh, placement) -> None:
    for name, p in list(module.named_parameters(recurse=False)):
        place = placement(name) if callable(placement) else placement
        module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, (place,)), p.requires_grad))


def _local(p: torch.Tensor | None, grad=None) -> torch.Tensor | None:
    if p is None:
        return None
    return p.to_local(grad_placements=grad)


def _linear_forward(mesh: DeviceMesh, grad, scatter: bool):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, _local(self.weight, grad), _local(self.bias, grad))
        return _scatter_sequence(y, mesh) if scatter else y
    return forward


def _norm_forward(module: nn.Module):
    """A norm on local tensors with its replicated weights' gradients left as partial sums."""
    if isinstance(module, nn.RMSNorm):
        def forward(self, x):
            return F.rms_norm(x, self.normalized_shape, _local(self.weight, _PARTIAL).to(x.dtype), self.eps)
    elif isinstance(module, nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, _local(self.weight, _PARTIAL), _local(self.bias, _PARTIAL),
                                self.eps)
    else:
        raise TypeError(f"parallel.tp_local_ops: no local form for {type(module).__name__}")
    return forward


def _replicated_forward(module: nn.Module):
    if isinstance(module, nn.Linear):
        return _linear_forward(None, _PARTIAL, scatter=False)
    return _norm_forward(module)


def localize(module: nn.Module, mesh: DeviceMesh, style: ParallelStyle | str) -> None:
    """Distribute ``module``'s parameters as ``style`` would and give it a forward on local tensors.
    ``style``: a :class:`RowwiseParallel` (the region's exit), a :class:`ColwiseParallel` (heads or FFN
    columns), ``"replicate"`` (norms, MLA's latent path, MQA's K/V head: every rank runs it whole)."""
    if isinstance(style, RowwiseParallel):
        _distribute(module, mesh, Shard(1))  # no bias: the model's row-parallel linears have none
        if module.bias is not None:
            raise TypeError("parallel.tp_local_ops: a row-parallel linear with a bias")
        forward = _linear_forward(mesh, None, scatter=True)
    elif isinstance(style, ColwiseParallel):
        _distribute(module, mesh, Shard(0))
        forward = _linear_forward(mesh, None, scatter=False)
    else:
        _distribute(module, mesh, Replicate())
        forward = _replicated_forward(module)
    module.forward = types.MethodType(forward, module)


def _entry(mesh: DeviceMesh):
    def hook(module, args):
        return (_gather_sequence(args[0], mesh), *args[1:])
    return hook


def _block_in(module, args):
    return (args[0].to_local(), *args[1:])  # the residual stream's Shard(1) DTensor -> this rank's shard


def _block_out(mesh: DeviceMesh):
    def hook(module, args, out):
        return DTensor.from_local(out, mesh, _SEQ, run_check=False)
    return hook


def _settled_sequence(mesh: DeviceMesh):
    """The embedding's output (a reduce-scatter's pending result) as a plain local shard, before the blocks:
    a compiled block's backward expects the type its forward input had."""
    def hook(module, args, out):
        local = out.to_local()
        if isinstance(local, AsyncCollectiveTensor):
            local = local.clone()  # waits; a new plain tensor on the autograd graph
        return DTensor.from_local(local, mesh, _SEQ, run_check=False)
    return hook


def localize_root(model: nn.Module, mesh: DeviceMesh) -> None:
    model.tok_embeddings.register_forward_hook(_settled_sequence(mesh))


def localize_block(block: nn.Module, mesh: DeviceMesh, styles: dict[str, ParallelStyle]) -> None:
    """One block under the local plan: ``styles`` is the DTensor plan's for the block's linears (by name)."""
    for name, style in styles.items():
        sub = block.get_submodule(name)
        if isinstance(style, (RowwiseParallel, ColwiseParallel)):
            localize(sub, mesh, style)
        elif name not in ("attn", "ffn"):  # the sequence-parallel norms and replicated modules; attn, ffn: below
            localize(sub, mesh, "replicate")
    block.attn.register_forward_pre_hook(_entry(mesh))
    block.ffn.register_forward_pre_hook(_entry(mesh))
    block.register_forward_pre_hook(_block_in)
    block.register_forward_hook(_block_out(mesh))
