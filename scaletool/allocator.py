"""The CUDA caching allocator's setting for every scaletool process: expandable segments, unless the user chose.

A large vocabulary's logits (Qwen2.5-1.5B at 13 sequences of 4,096 tokens: 15.07 GiB in one block) need one free
run of that size. With the allocator's default fixed-size segments, the blocks freed earlier in the step stay cached
in pieces: on 4 H200s, DeepSpeed ZeRO-1/2 at that micro-batch held 15.5 GiB cached but free, 14.3 GiB more unused
on the card, and still ran out of memory asking for the 15.07 GiB block, at an allocated peak 2.4% over the
estimate (benchmarks/results/plan-verify/4xh200-2026-11-27/). Expandable segments map new pages onto one growing
segment instead, so what is free can be used whatever its history (PyTorch's CUDA semantics notes, "Optimizing
memory usage with PYTORCH_CUDA_ALLOC_CONF"); torchtitan's launch script sets the same. The memory estimate's
reserve for the allocator (:data:`scaletool.analytic.step.ALLOCATOR_RESERVE_FRACTION`) assumes it.

Set before the first CUDA allocation: by the CLI for itself and every process it starts (torchrun, the DeepSpeed
launcher and Slurm pass the environment on), and again where a process group is joined (a program that imports
scaletool's engines directly). A ``PYTORCH_CUDA_ALLOC_CONF`` already in the environment is left exactly as it is.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def allocator_defaults(environ: MutableMapping[str, str] | None = None) -> str:
    """Set :data:`ENV` to :data:`DEFAULT` where it is unset; returns the value in effect."""
    env = os.environ if environ is None else environ
    return env.setdefault(ENV, DEFAULT)
