"""Expert parallelism: each rank of an expert-parallel group keeps E/P routed experts; tokens travel by all-to-all.

Capacity dispatch: the [E, C, d] buffer goes out and back by ``all_to_all_single`` in equal pieces (GShard
§3.2). Dropless: the rank's rows arrive sorted by expert with their counts; an all-to-all of the E counts
gives the split sizes (one host read per MoE layer), the rows go out and back in uneven pieces (the
backward swaps the sizes), and the received rows are regrouped by local expert with a gather for one
grouped GEMM per projection (the token dispatch of torchtitan's ``ExpertParallel`` and Megatron-Core's
``MoEAlltoAllTokenDispatcher``, over scaletool's sorted dispatch).

Expert weights are DTensors sharded on the expert dimension (``Shard(0)``), left out of FSDP2
(``ignored_params``). P equal to the D data-parallel ranks: FSDP2's own mesh. P < D: a (D/P, P) mesh
``("ep_replicate", "ep")``, experts replicated across the groups (``[Replicate(), Shard(0)]``) and their
gradients summed over the replicas (:func:`sync_replicated_expert_grads`). A hook divides each expert
gradient by D: the mean loss's gradient, as FSDP2's reduce-scatter averages the rest. Model code keeps no
distributed import: this module swaps each MoE layer's ``experts``, in the whole model or in one pipeline
stage's module (:func:`apply_expert_parallel` with ``require_moe=False``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.config import RecipeError
from scaletool.model.moe import GroupedExperts, _GatherRows, grouped_mm_supported, moe_layers, sorted_swiglu, swiglu_experts


def expert_parallel_mesh(dp_mesh: DeviceMesh, degree: int) -> DeviceMesh:
    """The mesh the routed experts are sharded over: ``dp_mesh`` itself when ``degree`` is its size, else a
    (D/degree, degree) mesh ``("ep_replicate", "ep")`` of the same ranks, row-major: an expert-parallel group
    is ``degree`` consecutive ranks (one node's, where a node holds a multiple of ``degree``)."""
    D = dp_mesh.size()
    if degree == D:
        return dp_mesh
    if dist.get_world_size() == D:
        return init_device_mesh(dp_mesh.device_type, (D // degree, degree), mesh_dim_names=("ep_replicate", "ep"))
    return DeviceMesh(dp_mesh.device_type, dp_mesh.mesh.reshape(D // degree, degree),
                      mesh_dim_names=("ep_replicate", "ep"))


def _ep_dim(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["ep"] if mesh.ndim == 2 else mesh


class ExpertParallelExperts(GroupedExperts):
    """The experts of one MoE layer, sharded by expert over ``mesh``'s last dimension; same parameter names.

    ``data_parallel``: the data-parallel ranks whose mean loss is trained (the gradient hook's divisor)."""

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh, data_parallel: int):
        nn.Module.__init__(self)
        ep = _ep_dim(mesh)
        self.group = ep.get_group()
        self.world = ep.size()  # P, the ranks one layer's experts are spread over
        self.local = experts.w1.shape[0] // self.world
        placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name).detach()
            local = full.chunk(self.world, dim=0)[ep.get_local_rank()].clone()
            param = nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False))
            # every data-parallel rank's tokens reach this shard (directly or through a replica summed in
            # sync_replicated_expert_grads): sum over ranks -> mean, as data parallelism averages
            param.register_hook(lambda g, n=data_parallel: g / n)
            setattr(self, name, param)

    def forward(self, buf: torch.Tensor) -> torch.Tensor:  # buf (E, C, d): this rank's tokens
        E, C, d = buf.shape
        W, local = self.world, self.local
        recv = funcol.all_to_all_single_autograd(buf.contiguous(), None, None, self.group)
        # recv (W·local, C, d), by source rank -> (local, W·C, d): each local expert's slots from every rank
        x = recv.view(W, local, C, d).transpose(0, 1).reshape(local, W * C, d)
        y = swiglu_experts(x, self.w1.to_local(), self.w2.to_local(), self.w3.to_local())
        y = y.view(local, W, C, d).transpose(0, 1).reshape(E, C, d)
        return funcol.all_to_all_single_autograd(y.contiguous(), None, None, self.group)

    def sorted_forward(self, x: torch.Tensor, counts: torch.Tensor, impl: str | None = None,
                       fuse_gate_up: bool = True) -> torch.Tensor:
        """Dropless: this rank's rows x (M, d) sorted by (global) expert, ``counts`` (E,) rows per expert ->
        the experts' outputs (M, d) in the same order, computed on the experts' ranks (module docstring).
        ``fuse_gate_up`` is accepted for the interface; the shard always runs gate and up as one GEMM."""
        W, local = self.world, self.local
        # counts (E,) = (W, local) by destination rank; received (W·local,) by source rank: the rows
        # each source sends for each of this rank's experts
        received = funcol.all_to_all_single(counts.contiguous(), None, None, self.group).view(W, local)
        sizes = torch.cat([counts.view(W, local).sum(1), received.sum(1)]).tolist()  # one host sync
        send, recv = sizes[:W], sizes[W:]
        rows = funcol.all_to_all_single_autograd(x.contiguous(), recv, send, self.group)  # (R, d) by source
        order, inverse = _by_local_expert(received, sum(recv))
        w1, w2, w3 = self.w1.to_local(), self.w2.to_local(), self.w3.to_local()
        w13 = torch.cat([w1.to(x.dtype), w3.to(x.dtype)], -1)
        mine = _GatherRows.apply(rows, order, inverse, 1)  # grouped by local expert, source order within
        impl = impl or ("grouped_mm" if grouped_mm_supported(mine, w1.shape[-1]) else "loop")
        y = sorted_swiglu(mine, w13, w2.to(x.dtype), received.sum(0), impl)
        back = _GatherRows.apply(y, inverse, order, 1)  # by source rank again
        return funcol.all_to_all_single_autograd(back.contiguous(), send, recv, self.group)


def _by_local_expert(received: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows, in segments (source s, local expert j) of ``received`` (W, local) rows, s-major ->
    the permutation that groups them j-major (every source's rows for expert 0, then expert 1, ...) and
    its inverse. Stable: within one (j, s) segment the source's order is kept."""
    W, local = received.shape
    device = received.device
    segment = torch.arange(W * local, device=device).repeat_interleave(received.reshape(-1), output_size=total)
    key = (segment % local) * W + segment // local
    order = key.argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(total, device=device))
    return order, inverse


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, degree: int = 0, require_moe: bool = True
                          ) -> set[nn.Parameter]:
    """Shard every MoE layer's routed experts of ``model`` over groups of ``degree`` of ``mesh``'s
    data-parallel ranks (0: all of them); returns the expert parameters (for FSDP2's ``ignored_params``).
    Call on the built, initialised model (or one pipeline stage's module, with ``require_moe=False`` where
    a stage may hold no MoE layer), before ``fully_shard``."""
    layers = moe_layers(model)
    D = mesh.size()
    degree = degree or D
    if not layers:
        if require_moe:
            raise RecipeError("parallel.expert_parallel: the model has no MoE layer (set model.ffn=moe)")
        return set()
    problems = ep_analytic.problems(layers[0].n_experts, D, degree)
    if problems:
        raise RecipeError(problems)
    if not dist.is_initialized():
        raise RecipeError("parallel.expert_parallel: needs a process group (engine fsdp)")
    ep_mesh = expert_parallel_mesh(mesh, degree)
    ignored: set[nn.Parameter] = set()
    for moe in layers:
        moe.experts = ExpertParallelExperts(moe.experts, ep_mesh, D)
        ignored.update(moe.experts.parameters())
    return ignored


def sync_replicated_expert_grads(model: nn.Module) -> None:
    """Expert-parallel groups smaller than the data-parallel ranks: sum each expert shard's gradient over
    its replicas (the ``ep_replicate`` dimension), one flat all-reduce. Nothing to do otherwise."""
    params = [p for m in moe_layers(model) if isinstance(m.experts, ExpertParallelExperts)
              for p in m.experts.parameters() if p.grad is not None and p.device_mesh.ndim == 2]
    if not params:
        return
    local = [p.grad.to_local() for p in params]
    flat = _flatten_dense_tensors(local)
    dist.all_reduce(flat, group=params[0].device_mesh["ep_replicate"].get_group())
    for p, t in zip(params, _unflatten_dense_tensors(flat, local)):
        p.grad = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False)
