"""One FSDP2 rank (world size from torchrun): tiny in bf16 under scaletool's FSDP engine, one micro-batch with
gradient sync off as accumulation runs it; prints what FSDP2 then holds between micro-batches, as JSON."""
import json
import sys

import torch

from scaletool.config import load_recipe
from scaletool.engines.dist import init_distributed
from scaletool.engines.fsdp import FSDPEngine
from scaletool.model import build_model

recipe = load_recipe(sys.argv[1], ["model.dtype=bf16", "parallel.engine=fsdp", "train.grad_accum_steps=2"])
env = init_distributed("fsdp")
model = build_model(recipe.model, env.device, seed=0)
engine = FSDPEngine(model, recipe, env)
tokens = torch.randint(0, recipe.model.vocab_size, (2, recipe.seq_len + 1), generator=torch.Generator().manual_seed(0))
with engine.grad_sync(False):
    engine.model(tokens[:, :-1], tokens[:, 1:]).backward()
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
params = sum(p.numel() for p in engine.model.parameters())  # DTensor numel: the global size
if env.rank == 0:
    print(json.dumps({**held, "dtypes": sorted(held["dtypes"]), "sharded_grads": sharded, "params": params}))
torch.distributed.destroy_process_group()
