"""One FSDP2 rank (world size from torchrun): tiny in bf16 under scaletool's FSDP engine, two micro-batches of one
optimizer step as accumulation runs them, with ``parallel.reduce_scatter_every`` from argv[2]. Prints, as JSON,
what FSDP2 holds between the two micro-batches and the global gradient norm after the second."""
import json
import sys

import torch

from scaletool.config import load_recipe
from scaletool.engines.dist import end_worker_process, init_distributed, leave_distributed
from scaletool.engines.fsdp import FSDPEngine
from scaletool.model import build_model

recipe = load_recipe(sys.argv[1], ["model.dtype=bf16", "parallel.engine=fsdp", "train.grad_accum_steps=2",
                                   f"parallel.reduce_scatter_every={sys.argv[2]}"])
env = init_distributed("fsdp")
model = build_model(recipe.model, env.device, seed=0)
engine = FSDPEngine(model, recipe, env)
gen = torch.Generator().manual_seed(env.rank)
batches = [torch.randint(0, recipe.model.vocab_size, (2, recipe.seq_len + 1), generator=gen) for _ in range(2)]


def micro_batch(tokens, last):
    with engine.grad_sync(last):
        (engine.model(tokens[:, :-1], tokens[:, 1:]) / 2).backward()


micro_batch(batches[0], last=False)
held = {"elements": 0, "bytes": 0, "dtypes": set()}
for module in engine.model.modules():
    state = getattr(module, "_get_fsdp_state", None)
    group = state()._fsdp_param_group if state is not None else None
    for fp in (group.fsdp_params if group is not None else []):
        g = fp.unsharded_accumulated_grad
        if g is not None:
            held["elements"] += g.numel()
            held["bytes"] += g.numel() * g.element_size()
            held["dtypes"].add(str(g.dtype))
sharded = sum(p.grad is not None for p in engine.model.parameters())
micro_batch(batches[1], last=True)
norm = torch.nn.utils.get_total_norm([p.grad for p in engine.model.parameters()]).full_tensor().item()
params = sum(p.numel() for p in engine.model.parameters())  # DTensor numel: the global size
if env.rank == 0:
    print(json.dumps({**held, "dtypes": sorted(held["dtypes"]), "sharded_grads_between": sharded, "params": params,
                      "grad_norm": norm}))
leave_distributed()
end_worker_process()  # skips the native teardown gloo's threads intermittently abort (engines.dist)
