"""FSDP2: ``fully_shard`` on every block, then on the root (embedding, final norm, head), over the
data-parallel ranks; with ``parallel.tensor_parallel`` N > 1, composed with tensor parallelism over a 2-D
``("dp", "tp")`` mesh, as torchtitan does. HSDP (``parallel.data_parallel_replicate`` R > 1): ``fully_shard`` over
a 2-D ``("dp_replicate", "dp_shard")`` mesh, sharding within each group of ``world_size / R`` ranks (a node) and
replicating across the R groups, as torchtitan's ``dp_replicate`` × ``dp_shard`` (× ``tp`` with tensor
parallelism: a 3-D mesh, :func:`~scaletool.engines.dist.device_mesh`).

Parameters, gradients and AdamW state are sharded; each block's 16-bit parameters are all-gathered just
before its forward (again before its backward when ``reshard_after_forward``) under a
``MixedPrecisionPolicy`` of 16-bit params and fp32 gradient reduction. ``cpu_offload``: shards and optimizer
step on the CPU. While accumulating, ``set_requires_gradient_sync(False)`` defers the reduce-scatter.

Tensor parallelism (:mod:`scaletool.engines.tp`) splits the layers first; FSDP2 then shards each rank's
pieces over the ``world_size / N`` data-parallel ranks (2-D DTensors). Micro-batches run under
``loss_parallel`` (vocabulary-sharded logits). Pure tensor parallelism (one data-parallel rank) skips
FSDP2, as torchtitan does: over one rank it shards nothing, and its per-block hooks (the post-backward
redistributes every gradient DTensor) cost host time a host-bound step pays in full. The split model then
trains as the single engine does (fp32 parameters, autocast) and :meth:`FSDPEngine.finish_grads` reduces
the replicated weights' partial gradients; ``parallel.fsdp_on_one_rank`` keeps FSDP2 there.
"""
from __future__ import annotations

import warnings
from contextlib import ExitStack

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from scaletool.config import RecipeError
from scaletool.engines.dist import device_mesh
from scaletool.engines.expert_parallel import apply_expert_parallel, sync_replicated_expert_grads
from scaletool.engines.single import SingleEngine
from scaletool.engines.tp import apply_tensor_parallel, enable_async_tp
from scaletool.kinds.engines import FSDP
from scaletool.model.layers import TORCH_DTYPES as DTYPES


class FSDPEngine(SingleEngine):
    name = "fsdp"
    casts_params = True

    def __init__(self, model: nn.Module, recipe, env):
        #: tensor parallelism over every rank: no FSDP2 (module docstring), unless the recipe asks for it
        self.pure_tp = recipe.parallel.pure_tensor_parallel(env.world_size)
        self.casts_params = not self.pure_tp  # without FSDP2's mixed-precision policy: autocast
        super().__init__(model, recipe, env)
        if self.pure_tp:
            self.clip_in_optimizer = False  # the parameters are DTensors: clipping stays outside fused AdamW

    def shard_tensors(self, model: nn.Module) -> None:
        tp = self.recipe.parallel.tensor_parallel
        self.mesh = device_mesh(self.env, tp, self.recipe.parallel.data_parallel_replicate)
        if tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], self.recipe.model, self.recipe.parallel.tp_local_ops)
            if self.recipe.parallel.async_tp:
                if self.env.device.type != "cuda":
                    raise RecipeError([f"parallel.async_tp: needs CUDA devices (symmetric memory), "
                                       f"not {self.env.device.type}"])
                enable_async_tp(self.mesh["tp"])
            # DTensor warns that its random ops lack CPU support (its offset-based generator is for GPUs);
            # dropout on a rank's sequence shard then draws from the rank's own generator, which the
            # trainer seeds per rank and step: independent masks, all dropout needs
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support",
                                    category=UserWarning)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.pure_tp:
            return model
        p = self.recipe.parallel
        # HSDP: the 2-D (replicate, shard) mesh itself; fully_shard shards over its last dimension and replicates over
        # the first (reduce-scatter within a shard group, then all-reduce of the shard across the replicas)
        mesh = self.mesh["dp_replicate", "dp_shard"] if p.data_parallel_replicate > 1 else self.mesh["dp"]
        dtype = self.recipe.model.dtype
        mp = (MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
              if dtype != "fp32" else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy() if p.cpu_offload else OffloadPolicy()
        # expert parallelism shards the routed experts itself (DTensors on the same mesh): FSDP leaves them alone
        ignored = apply_expert_parallel(model, mesh, p.expert_parallel_degree) if p.expert_parallel else None
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=p.reshard_after_forward, **kw)
        # the root's parameters (embedding, head) are used last in the forward and first in the
        # backward: resharding them in between would only add an all-gather
        fully_shard(model, reshard_after_forward=False, **kw)
        return model

    def grad_sync(self, enabled: bool):
        if not self.pure_tp:  # pure TP: no data-parallel ranks to reduce over
            # parallel.reduce_scatter_every=micro-batch: sync on every micro-batch, so FSDP2 reduce-scatters each
            # one's gradients into the sharded .grad instead of holding them unsharded until the last
            every = self.recipe.parallel.reduce_scatter_every == "micro-batch"
            self.model.set_requires_gradient_sync(enabled or every)
        stack = ExitStack()
        if self.recipe.parallel.tensor_parallel > 1:
            stack.enter_context(loss_parallel())  # the cross-entropy over vocabulary-sharded logits, and its backward
        return stack

    def finish_grads(self) -> None:
        """Pure TP: every gradient in its parameter's placement, as FSDP2's post-backward leaves them. The
        replicated parameters' gradients come out of the backward as per-rank partial sums (``Partial``): one
        flat all-reduce over the group sums them; any other mismatch (a vocabulary-sharded weight whose
        gradient came out whole) is a local redistribute. Expert parallelism over groups smaller than the
        data-parallel ranks: the expert shards' gradients summed over their replicas."""
        if self.recipe.parallel.expert_parallel:
            sync_replicated_expert_grads(self.model)
        if not self.pure_tp:
            return
        partial, other = [], []
        for p in self.model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and g.placements != p.placements:
                (partial if all(pl.is_partial() for pl in g.placements) and all(pl.is_replicate() for pl in p.placements)
                 else other).append(p)
        if partial:
            local = [p.grad.to_local() for p in partial]
            flat = _flatten_dense_tensors(local)
            dist.all_reduce(flat, group=self.mesh["tp"].get_group())
            for p, t in zip(partial, _unflatten_dense_tensors(flat, local)):
                p.grad = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False)
        for p in other:
            p.grad = p.grad.redistribute(placements=p.placements)


FSDP.provide(constructor=FSDPEngine)
