"""What each position encoding costs a training step, and which attention kernel it runs.

Usage: python benchmarks/scripts/position_encodings.py RECIPE [--steps N] [--device cuda|cpu] [--set KEY=VALUE ...]
       [--out FILE]

For every ``model.position_encoding`` (rope, learned, sinusoidal, alibi, none; an MHA/GQA/MQA recipe, since
MLA takes rope only) it builds the recipe's model and times forward + backward of one micro-batch
(train.micro_batch_size × seq_len; autocast at model.dtype on CUDA, fp32 on CPU). The encodings take turns
step by step, so drift on a shared machine hits all alike; each one's first steps are excluded by
``scaletool.stats.settled_start``, and each is compared with rope by ``scaletool.stats.compare`` (a
difference only beyond the noise). Prints one JSON object: per encoding the step-time spread, the
comparison, and the attention operators the profiler saw in one step (the SDPA aten op on CPU; on CUDA
the kernels: ALiBi's float bias rules out flash, so cuDNN or memory-efficient attention runs); ``--out``
writes it to a file instead (the profiler's own log lines go to stdout too).
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from scaletool.config import load_recipe
from scaletool.measure.timing import StepTimer
from scaletool.model import build_model
from scaletool.model.layers import TORCH_DTYPES
from scaletool.stats import compare, settled_start, spread

ENCODINGS = ("rope", "learned", "sinusoidal", "alibi", "none")
KERNEL_WORDS = ("flash", "cudnn", "fmha", "efficient", "attention", "sdpa")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    runs = {}
    for enc in ENCODINGS:
        r = load_recipe(a.recipe, [*a.sets, f"model.position_encoding={enc}"])
        x = torch.randint(r.model.vocab_size, (r.train.micro_batch_size, r.seq_len), device=dev,
                          generator=torch.Generator(dev).manual_seed(0))
        runs[enc] = (build_model(r.model, dev, seed=0, sdpa_backend=r.train.sdpa_backend), x)
    amp = TORCH_DTYPES[r.model.dtype] if dev.type == "cuda" and r.model.dtype != "fp32" else None

    def step(enc: str) -> None:
        model, x = runs[enc]
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            loss = model(x, x)
        loss.backward()
        model.zero_grad(set_to_none=True)

    timers = {enc: StepTimer(dev) for enc in ENCODINGS}  # CUDA events per step, read after one sync at the end
    for _ in range(a.steps):
        for enc in ENCODINGS:
            with timers[enc].step():
                step(enc)
    times = {enc: t.seconds() for enc, t in timers.items()}
    spreads = {enc: spread(ts[settled_start(ts, 1):]) for enc, ts in times.items()}
    out = {"recipe": a.recipe, "sets": a.sets, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "batch": list(runs["rope"][1].shape), "encodings": {}}
    for enc in ENCODINGS:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step(enc)
        ops = sorted({e.key[:120] for e in prof.key_averages()
                      if any(w in e.key.lower() for w in KERNEL_WORDS) and (dev.type == "cpu" or e.device_type.name == "CUDA")})
        c = compare(spreads[enc], spreads["rope"])
        out["encodings"][enc] = {"step_s": spreads[enc].model_dump(), "vs_rope": c.describe("slower", "faster"),
                                 "vs_rope_rel": c.rel_diff, "attention_ops": ops}
    text = json.dumps(out, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
