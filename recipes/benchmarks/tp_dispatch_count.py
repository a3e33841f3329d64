"""DTensor dispatches per training step under tensor parallelism, counted on CPU with gloo (eager, no compile):
each aten op called with a DTensor argument is one trip through DTensor's host-side dispatch (sharding
propagation, maybe a redistribute, then the local op). Rank 0 prints JSON: per step the DTensor ops (and
by phase: forward, backward with gradient clipping, optimizer), the local ops, the collectives, and the
forward's DTensor ops per module of block 0 (the innermost module running).

    torchrun --nproc-per-node 2 recipes/benchmarks/tp_dispatch_count.py recipes/tiny.yaml [--set KEY=VALUE ...]
"""
from __future__ import annotations

import json
import sys
from collections import Counter

import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scaletool import api
from scaletool.engines import data_parallel, init_distributed, make_engine
from scaletool.train.data import make_source


class Count(TorchDispatchMode):
    """Counts every aten op: those with a DTensor argument (DTensor's dispatch) and the rest (local work)."""

    def __init__(self):
        super().__init__()
        self.dtensor, self.local, self.collectives, self.by_module = Counter(), Counter(), 0, Counter()
        self.where: list[str] = []
        self.phase, self.by_phase = "forward", Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {}))):
            self.dtensor[str(func.overloadpacket)] += 1
            self.by_phase[self.phase] += 1
            if self.where:
                self.by_module[self.where[-1]] += 1
        else:
            self.local[str(func.overloadpacket)] += 1
            self.collectives += "c10d" in str(func.namespace)
        return func(*args, **(kwargs or {}))


def main() -> None:
    sets = [a for a in sys.argv[2:] if a != "--set"]
    r = api.resolve(sys.argv[1], ["parallel.engine=fsdp", "parallel.tensor_parallel=2", "train.compile=false", *sets])
    env = init_distributed(r.parallel.engine)
    engine = make_engine(r, env)
    batch = make_source(r, *data_parallel(env, r.parallel.tensor_parallel)).batch(0, 0)
    engine.train_step([batch], r.train.lr)  # first use: anything done once is not a step's
    count = Count()
    block = engine.model.layers[0]
    engine.model.register_forward_hook(lambda m, a, o: setattr(count, "phase", "backward"))
    engine.optimizer.register_step_pre_hook(lambda o, a, k: setattr(count, "phase", "optimizer"))
    for name, mod in block.named_modules():  # forward only: which of block 0's modules dispatch how often
        if name:  # the innermost module running gets the op (attn: the attention's own code between its linears)
            mod.register_forward_pre_hook(lambda m, a, n=name: count.where.append(n))
            mod.register_forward_hook(lambda m, a, o: count.where.pop() and None)
    with count:
        engine.train_step([batch], r.train.lr)
    if env.rank == 0:
        print(json.dumps({
            "attention": r.model.attention, "n_layers": r.model.n_layers, "tensor_parallel": 2,
            "per_step": {"dtensor_ops": sum(count.dtensor.values()), "local_ops": sum(count.local.values()),
                         "collectives": count.collectives},
            "dtensor_ops_by_phase": dict(count.by_phase),
            "dtensor_ops_per_block": round(sum(count.dtensor.values()) / r.model.n_layers, 1),
            "block0_forward_dtensor_ops_by_module": dict(count.by_module.most_common()),
            "top_dtensor_ops": dict(count.dtensor.most_common(12))}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
