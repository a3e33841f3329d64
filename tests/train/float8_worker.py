"""One rank of the FSDP2 float8 test job (started by tests/train/test_float8.py under torchrun).

``float8_worker.py RECIPE OUT MODE``: every rank trains the recipe under FSDP2 with ``train.float8=MODE`` into
``OUT/MODE``; the CPU stands in for a GPU with FP8 (torch._scaled_mm has CPU kernels; the hardware check is
replaced). Rank 0 writes, for each swapped layer, whether it gathers in FP8, to ``OUT/MODE.gathers.json``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from scaletool import api
from scaletool.engines import float8
from scaletool.engines.dist import end_worker_process, leave_distributed


def main(recipe: str, out: Path, mode: str) -> None:
    float8.hardware_problem = lambda device=None: None
    sets = ["model.dtype=bf16", "parallel.engine=fsdp", "train.steps=4", "train.measure_warmup_steps=1",
            f"train.float8={mode}"]
    captured = {}
    real = float8.convert

    def convert(model, r):
        report = real(model, r)
        captured.update({f: bool(model.get_submodule(f).config.enable_fsdp_float8_all_gather) for f in report["swapped"]})
        return report

    float8.convert = convert
    api.train(recipe, overrides=sets, out=out / mode, quiet=True, measure=False)
    if os.environ["RANK"] == "0":
        (out / f"{mode}.gathers.json").write_text(json.dumps(captured))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    leave_distributed()
    end_worker_process()  # skips the native teardown gloo's threads intermittently abort (engines.dist)
