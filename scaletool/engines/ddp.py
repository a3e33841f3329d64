"""DistributedDataParallel: full replicas, gradients all-reduced in buckets during the backward.

While accumulating, ``no_sync`` skips the all-reduce until the last micro-batch.
"""
from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletool.engines.single import SingleEngine
from scaletool.kinds.engines import DDP as DDP_KIND


class DDPEngine(SingleEngine):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        cuda = self.env.device.type == "cuda"
        return DDP(model, device_ids=[self.env.device.index] if cuda else None, gradient_as_bucket_view=True)

    def grad_sync(self, enabled: bool):
        return super().grad_sync(enabled) if enabled else self.model.no_sync()


DDP_KIND.provide(constructor=DDPEngine)
