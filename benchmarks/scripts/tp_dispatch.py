"""Count one training step's DTensor dispatches, plain ops, collectives and DTensor wrapper calls under
tensor parallelism (:class:`scaletool.measure.dispatch.DispatchCount`), job by job, in one process group.

  torchrun --nproc-per-node 2 benchmarks/scripts/tp_dispatch.py --out counts.json
  torchrun --nproc-per-node 2 benchmarks/scripts/tp_dispatch.py --out c.json \\
      --recipe recipes/tiny.yaml --job mla= --job mla-local=parallel.tp_local_ops=true

Each ``--job NAME=SET,SET`` trains one warm-up step, then counts the next (forward, backward, clipping,
optimizer) on rank 0. Without ``--job``: mha and mla, each with the DTensor plan and the local one. The
counts depend on the plan and the layer count, not on the device or the sizes, so the tiny recipe on CPU
(gloo) gives a GPU run's counts. Rank 0 writes ``--out`` (JSON: jobs, torch version, command).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from scaletool import api
from scaletool.config import RecipeError
from scaletool.engines import data_parallel, init_distributed, make_engine
from scaletool.measure.dispatch import DispatchCount
from scaletool.train.data import make_source

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JOBS = {"mha": ["model.attention=mha"], "mha-local": ["model.attention=mha", "parallel.tp_local_ops=true"],
                "mla": [], "mla-local": ["parallel.tp_local_ops=true"]}


def parse_jobs(values: list[str]) -> dict[str, list[str]] | str:
    """NAME=SET,SET -> {NAME: [SET, ...]}, or the error line."""
    jobs: dict[str, list[str]] = {}
    for v in values:
        name, sep, sets = v.partition("=")
        if not sep or not name:
            return f"--job {v!r}: expected NAME=KEY=VALUE,KEY=VALUE (or NAME= for none)"
        jobs[name] = [s for s in sets.split(",") if s]
    return jobs


def count(recipe: str, sets: list[str]) -> dict:
    r = api.resolve(recipe, sets)
    env = init_distributed(r.parallel.engine)
    engine = make_engine(r, env)
    source = make_source(r, *data_parallel(env, r.parallel.tensor_parallel))
    engine.train_step([source.batch(0, 0)], r.train.lr)  # first use: anything done once is not a step's
    with DispatchCount() as c:
        engine.train_step([source.batch(1, 0)], r.train.lr)
    return c.summary() | {"n_layers": r.model.n_layers, "overrides": sets}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny.yaml"))
    ap.add_argument("--tp", type=int, default=None, help="parallel.tensor_parallel (default: the world size)")
    ap.add_argument("--job", action="append", default=[], help="NAME=KEY=VALUE,KEY=VALUE (repeatable)")
    a = ap.parse_args(argv)
    jobs = parse_jobs(a.job) if a.job else DEFAULT_JOBS
    problem = jobs if isinstance(jobs, str) else None
    if problem is None and "RANK" not in os.environ:
        problem = "run under torchrun (e.g. torchrun --nproc-per-node 2 ...)"
    if problem is None:
        try:
            for sets in jobs.values():
                api.resolve(a.recipe, ["parallel.engine=fsdp", f"parallel.tensor_parallel={a.tp or 2}", *sets])
        except RecipeError as e:
            problem = "; ".join(e.problems)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)  # one group for every job
    tp = a.tp or dist.get_world_size()
    common = ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}", "train.micro_batch_size=2"]
    out = {name: count(a.recipe, common + sets) for name, sets in jobs.items()}
    if dist.get_rank() == 0:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"jobs": out, "world_size": dist.get_world_size(), "torch": torch.__version__,
                                     "device": "cuda" if backend == "nccl" else "cpu",
                                     "command": ["torchrun", *sys.argv]}, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
