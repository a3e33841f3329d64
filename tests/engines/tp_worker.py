"""One rank of the tensor-parallel test job (started by tests/engines/test_tensor_parallel.py under torchrun).

``tp_worker.py RECIPE OUT JOBS MEASURE``: JOBS is a JSON mapping of job name -> ``--set`` overrides.
Every rank trains each job through ``scaletool.api.train`` into ``OUT/<name>`` (one process start for
all of them). A job that saved checkpoints is then copied without its summary, as if killed after its
last checkpoint, and every rank resumes the copy in ``OUT/<name>-resumed``. Last, the engine of the
MEASURE overrides runs one optimizer step's forward and backward (one micro-batch) and what follows the
backward before the optimizer (``finish_grads``) under
:class:`~scaletool.measure.collectives.CollectiveLog`, and rank 0 writes what it issued, by mesh
dimension and op, to ``OUT/collectives.json``. The test reads the summaries and that file.
``TP_WORKER_COMPILE_BACKEND`` set: ``torch.compile`` (``train.compile``) uses that backend.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from scaletool import api
from scaletool.engines import data_parallel, init_distributed, make_engine
from scaletool.engines.dist import end_worker_process, leave_distributed
from scaletool.measure.collectives import CollectiveLog
from scaletool.train.data import make_source


def train(recipe: str, out: Path, jobs: dict[str, list[str]]) -> None:
    for name, sets in jobs.items():
        api.train(recipe, overrides=sets, out=out / name, quiet=True, measure=False)
        if not (out / name / "checkpoints").is_dir():
            continue
        again = out / f"{name}-resumed"
        if os.environ["RANK"] == "0":
            shutil.copytree(out / name, again, ignore=shutil.ignore_patterns("summary.json"))
        dist.barrier()
        api.train(recipe, overrides=sets, out=again, resume="required", quiet=True, measure=False)


def measure(recipe: str, out: Path, sets: list[str]) -> None:
    r = api.resolve(recipe, sets)
    env = init_distributed(r.parallel.engine)
    engine = make_engine(r, env)
    batch = make_source(r, *data_parallel(env, r.parallel.tensor_parallel)).batch(0, 0)
    engine.train_step([batch], r.train.lr)  # first use: anything done once is not a step's
    dims = {tuple(engine.mesh[dim].mesh.tolist()): dim for dim in engine.mesh.mesh_dim_names}
    with CollectiveLog() as log:
        with engine.grad_sync(True):
            engine.model(*batch).backward()
        engine.finish_grads()  # pure TP: the replicated weights' gradients, reduced after the backward
    if env.rank == 0:
        found = {f"{dims[ranks]}:{op}": v for (ranks, op), v in log.totals().items()}
        (out / "collectives.json").write_text(json.dumps(found))


if __name__ == "__main__":
    if os.environ.get("TP_WORKER_COMPILE_BACKEND"):  # train.compile through this backend
        torch.compile = functools.partial(torch.compile, backend=os.environ["TP_WORKER_COMPILE_BACKEND"])
    dist.init_process_group("gloo")  # one group for every run (a run joins the group it finds and leaves it up)
    train(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
    measure(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[4]))
    # leave the group, then skip the interpreter's native teardown, as train's ranks do: gloo's threads
    # intermittently abort it ("terminate called without an active exception", a CI run of the 2 x 2 layout)
    leave_distributed()
    end_worker_process()
