"""FSDP2: ``fully_shard`` on every block, then on the root (which takes the embedding, final norm
and head), over a 1-D device mesh of all ranks.

Parameters, gradients and AdamW state are sharded; each block's 16-bit parameters are all-gathered
just before its forward (and again before its backward when ``reshard_after_forward``) under a
``MixedPrecisionPolicy`` of 16-bit params and fp32 gradient reduction. ``cpu_offload`` keeps the
shards and the optimizer step on the CPU (``CPUOffloadPolicy``). While accumulating,
``set_requires_gradient_sync(False)`` defers the reduce-scatter to the last micro-batch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from scaletool.engines.expert_parallel import apply_expert_parallel
from scaletool.engines.single import SingleEngine
from scaletool.model.layers import TORCH_DTYPES as DTYPES


class FSDPEngine(SingleEngine):
    name = "fsdp"
    auto_compile_scope = "block"
    casts_params = True

    def wrap(self, model: nn.Module) -> nn.Module:
        p, env = self.recipe.parallel, self.env
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        dtype = self.recipe.model.dtype
        mp = (MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
              if dtype != "fp32" else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy() if p.cpu_offload else OffloadPolicy()
        # expert parallelism shards the routed experts itself (DTensors on the same mesh): FSDP leaves them alone
        ignored = apply_expert_parallel(model, mesh) if p.expert_parallel else None
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=p.reshard_after_forward, **kw)
        # the root's parameters (embedding, head) are used last in the forward and first in the
        # backward: resharding them in between would only add an all-gather
        fully_shard(model, reshard_after_forward=False, **kw)
        return model

    def grad_sync(self, enabled: bool):
        self.model.set_requires_gradient_sync(enabled)
        return super().grad_sync(enabled)
