"""Where a training step's GPU time goes: kernels by category for one recipe on one GPU.

Usage: python benchmarks/scripts/profile_step.py RECIPE [--set k=v ...] [--top N]
Builds the recipe's engine as `scaletool train` does, runs train.measure_warmup_steps steps, then
profiles two steps and prints one JSON object: CUDA time per category (matmul, attention,
optimizer, Inductor's fused kernels, other) and the N (default 25) most expensive kernels.
"""
from __future__ import annotations

import argparse
import json

import torch
from probe_args import positive_int
from torch.profiler import ProfilerActivity, profile

from scaletool.config import load_recipe
from scaletool.engines import init_distributed, make_engine
from scaletool.errors import RecipeError
from scaletool.train.data import make_source
from scaletool.train.schedule import lr_at

ap = argparse.ArgumentParser(description="Where a training step's GPU time goes (JSON on stdout).")
ap.add_argument("recipe", help="a recipe name or YAML file")
ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
ap.add_argument("--top", type=positive_int, default=25, help="kernels listed (default 25)")
opts = ap.parse_args()
try:
    r = load_recipe(opts.recipe, opts.sets)
except RecipeError as e:
    ap.error(str(e).splitlines()[0][:300])
if not torch.cuda.is_available():
    ap.error("the profile needs a CUDA GPU")
env = init_distributed(r.parallel.engine)
engine = make_engine(r, env)
src = make_source(r, 0, 1)


def step(i):
    batches = [tuple(x.to(env.device) for x in src.batch(i, m)) for m in range(r.train.grad_accum_steps)]
    return engine.train_step(batches, lr_at(i, r.train))


for i in range(max(r.train.measure_warmup_steps, 3)):
    step(i)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(2):
        step(10 + i)
    torch.cuda.synchronize()


def category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "cudnn")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "_mm_", "splitk")):
        return "matmul"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if n.startswith("triton_"):
        return "fused (inductor)"
    return "elementwise/other"


cats: dict[str, float] = {}
rows = []
for e in prof.key_averages():
    if e.device_type.name != "CUDA" or e.device_time_total <= 0:
        continue
    cats[category(e.key)] = cats.get(category(e.key), 0.0) + e.device_time_total / 2e3  # ms per step
    rows.append((e.device_time_total / 2e3, e.count // 2, e.key[:140]))
rows.sort(reverse=True)
print(json.dumps({"recipe": opts.recipe, "overrides": opts.sets, "device": torch.cuda.get_device_name(),
                  "ms_per_step_by_category": cats, "ms_per_step_total": sum(cats.values()),
                  "top_kernels_ms_per_step": [{"ms": round(a, 3), "calls": b, "name": c} for a, b, c in rows[:opts.top]]},
                 indent=1))
