"""Expert parallelism: each rank keeps E/W routed experts; tokens travel by all-to-all.

``parallel.expert_parallel: true`` (engine fsdp). Every rank routes its own tokens and fills its
[E, C, d] dispatch buffer as in one process (:meth:`scaletool.model.moe.MoE.dispatch`); the
buffer's expert dimension is then split across ranks with ``all_to_all_single``, so rank r receives
the slots of its experts [r·E/W, (r+1)·E/W) from every rank, runs them with one bmm per
projection over the W·C slots, and a second all-to-all returns the outputs to the tokens' ranks
(GShard §3.2, DeepSpeed-MoE). Both all-to-alls are autograd-aware functional collectives
(``all_to_all_single_autograd``, which torch.compile also traces), so the backward reverses them.

The expert weights become DTensors sharded on the expert dimension (``Shard(0)``) over the same
1-D mesh as FSDP2, which leaves them alone (``ignored_params``): the optimizer, gradient clipping
(the global norm reduces over the shards) and ``torch.distributed.checkpoint`` treat them like
any other sharded parameter. Rank r's expert gradient sums the contributions of every rank's
tokens, while data-parallel gradients average over ranks; a hook divides it by W so both are the
gradient of the mean loss, and the run matches the one-process run with the same global batch.

The all-to-all needs the same capacity C on every rank: equal micro-batch shapes, as the data
loader gives; so expert parallelism takes ``moe_dispatch: capacity`` (the recipe check refuses the
dropless dispatch, whose per-expert token counts differ from rank to rank and step to step).
Model code keeps no distributed import: this module swaps the ``experts`` of every
:class:`~scaletool.model.moe.MoE` layer.
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
