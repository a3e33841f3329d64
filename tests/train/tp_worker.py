"""One rank of the tensor-parallel test job (started by tests/train/test_tensor_parallel.py under torchrun).

``tp_worker.py RECIPE OUT JOBS``: JOBS is a JSON mapping of job name -> ``--set`` overrides. Every
rank trains each job through ``scaletool.api.train`` into ``OUT/<name>`` (one process start for all
of them). A job that saved checkpoints is then copied without its summary, as if killed after its
last checkpoint, and every rank resumes the copy in ``OUT/<name>-resumed``. The test reads the summaries.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from scaletool import api


def main(recipe: str, out: Path, jobs: dict[str, list[str]]) -> None:
    dist.init_process_group("gloo")  # one group for every run (a run joins the group it finds and leaves it up)
    for name, sets in jobs.items():
        api.train(recipe, overrides=sets, out=out / name, quiet=True, measure=False)
        if not (out / name / "checkpoints").is_dir():
            continue
        again = out / f"{name}-resumed"
        if os.environ["RANK"] == "0":
            shutil.copytree(out / name, again, ignore=shutil.ignore_patterns("summary.json"))
        dist.barrier()
        api.train(recipe, overrides=sets, out=again, resume="required", quiet=True, measure=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
