"""Which attention kernels run, forward and backward, for a recipe's block under torch.compile.

Usage: python benchmarks/scripts/sdpa_dispatch.py RECIPE [--eager]
Prints one JSON object: the attention kernels the profiler saw (names containing flash, cudnn,
fmha, efficient or attention) with their counts and CUDA time, for one forward+backward of the
recipe's first block at its micro-batch and sequence length.
"""
from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from scaletool.config import load_recipe
from scaletool.model import build_model

r = load_recipe(sys.argv[1], ["model.n_layers=1"])
eager = "--eager" in sys.argv
model = build_model(r.model, "cuda", seed=0, sdpa_backend=r.train.sdpa_backend)
block = model.layers[0]
if not eager:
    block.compile()
B, T, d = r.train.micro_batch_size, r.seq_len, r.model.d_model
x = torch.randn(B, T, d, device="cuda", requires_grad=True)
positions = model.positions(0, T, T, torch.bfloat16)  # RoPE tables (and an ALiBi bias, shared by the layers)
for _ in range(3):  # compile and warm up
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = block(x, positions)
    y.float().square().mean().backward()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = block(x, positions)
    y.float().square().mean().backward()
    torch.cuda.synchronize()
keys = ("flash", "cudnn", "fmha", "efficient", "attention", "sdpa")
kernels = {}
for e in prof.key_averages():
    name = e.key
    if any(k in name.lower() for k in keys) and e.device_type.name == "CUDA":
        kernels[name[:160]] = {"count": e.count, "cuda_time_us": e.device_time_total}
print(json.dumps({"recipe": sys.argv[1], "compiled": not eager, "attention": r.model.attention,
                  "qk_head_dim": r.model.qk_head_dim, "v_head_dim": r.model.v_dim,
                  "device": torch.cuda.get_device_name(), "kernels": kernels}, indent=2))
