"""Expert parallelism: each rank keeps E/W routed experts; tokens travel by all-to-all.

Every rank routes its own tokens into the [E, C, d] capacity buffer
(:meth:`scaletool.model.moe.MoE.dispatch`); an autograd-aware ``all_to_all_single`` sends each expert's
slots to its rank and a second one brings the outputs back (GShard §3.2). Expert weights are DTensors
sharded on the expert dimension, left alone by FSDP2, so optimizer, clipping and checkpoints treat them
like other sharded parameters; a hook divides their gradient by W so it is the mean loss's gradient.
The all-to-all needs equal capacity on every rank, hence ``moe_dispatch: capacity`` only.
Model code keeps no distributed import: this module swaps each MoE layer's ``experts``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from scaletool.config import RecipeError
from scaletool.model.moe import GroupedExperts, moe_layers, swiglu_experts


class ExpertParallelExperts(GroupedExperts):
    """The experts of one MoE layer, sharded over ``mesh`` by expert; same parameter names."""

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh):
        nn.Module.__init__(self)
        self.group = mesh.get_group()
        self.world = mesh.size()
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name).detach()
            local = full.chunk(self.world, dim=0)[mesh.get_local_rank()].clone()
            param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
            # every rank's tokens reach this shard: sum over ranks -> mean, as data parallelism averages
            param.register_hook(lambda g, w=self.world: g / w)
            setattr(self, name, param)

    def forward(self, buf: torch.Tensor) -> torch.Tensor:  # buf (E, C, d): this rank's tokens
        E, C, d = buf.shape
        W, local = self.world, E // self.world
        recv = funcol.all_to_all_single_autograd(buf.contiguous(), None, None, self.group)
        # recv (W·local, C, d), by source rank -> (local, W·C, d): each local expert's slots from every rank
        x = recv.view(W, local, C, d).transpose(0, 1).reshape(local, W * C, d)
        y = swiglu_experts(x, self.w1.to_local(), self.w2.to_local(), self.w3.to_local())
        y = y.view(local, W, C, d).transpose(0, 1).reshape(E, C, d)
        return funcol.all_to_all_single_autograd(y.contiguous(), None, None, self.group)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard every MoE layer's routed experts over ``mesh``; returns the expert parameters (for
    FSDP2's ``ignored_params``). Call on the built, initialised model, before ``fully_shard``."""
    layers = moe_layers(model)
    W = mesh.size()
    if not layers:
        raise RecipeError("parallel.expert_parallel: the model has no MoE layer (set model.ffn=moe)")
    E = layers[0].n_experts
    if E % W:
        raise RecipeError(f"parallel.expert_parallel: {E} routed experts do not split over {W} ranks")
    if not dist.is_initialized():
        raise RecipeError("parallel.expert_parallel: needs a process group (engine fsdp)")
    ignored: set[nn.Parameter] = set()
    for moe in layers:
        moe.experts = ExpertParallelExperts(moe.experts, mesh)
        ignored.update(moe.experts.parameters())
    return ignored
