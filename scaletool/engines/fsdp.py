"""FSDP2: ``fully_shard`` on every block, then on the root (which takes the embedding, final norm
and head), over the data-parallel ranks; with ``parallel.tensor_parallel`` N > 1, composed with
tensor parallelism over a 2-D ``("dp", "tp")`` mesh, as torchtitan does.

Parameters, gradients and AdamW state are sharded; each block's 16-bit parameters are all-gathered
just before its forward (and again before its backward when ``reshard_after_forward``) under a
``MixedPrecisionPolicy`` of 16-bit params and fp32 gradient reduction. ``cpu_offload`` keeps the
shards and the optimizer step on the CPU (``CPUOffloadPolicy``). While accumulating,
``set_requires_gradient_sync(False)`` defers the reduce-scatter to the last micro-batch.

Tensor parallelism (:mod:`scaletool.engines.tp`) splits the layers first; FSDP2 then shards each
rank's tensor-parallel pieces over the ``world_size / N`` data-parallel ranks (2-D DTensors). A pure
tensor-parallel run is this engine with world size N: FSDP2 over a one-rank data mesh communicates
nothing (its all-gathers are local copies) and still gives the mixed-precision policy and the
reduction of replicated weights' partial gradients that tensor parallelism needs, as in torchtitan.
The forward and backward of a micro-batch run under ``loss_parallel`` (vocabulary-sharded logits).
"""
from __future__ import annotations

import warnings
from contextlib import ExitStack

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from scaletool.config import RecipeError
from scaletool.engines.dist import device_mesh
from scaletool.engines.expert_parallel import apply_expert_parallel
from scaletool.engines.single import SingleEngine
from scaletool.engines.tp import apply_tensor_parallel, enable_async_tp
from scaletool.model.layers import TORCH_DTYPES as DTYPES


class FSDPEngine(SingleEngine):
    name = "fsdp"
    auto_compile_scope = "block"
    casts_params = True

    def shard_tensors(self, model: nn.Module) -> None:
        tp = self.recipe.parallel.tensor_parallel
        self.mesh = device_mesh(self.env, tp)
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
        p = self.recipe.parallel
        mesh = self.mesh["dp"]
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
        stack = ExitStack()
        if self.recipe.parallel.tensor_parallel > 1:
            stack.enter_context(loss_parallel())  # the cross-entropy over vocabulary-sharded logits, and its backward
        return stack
