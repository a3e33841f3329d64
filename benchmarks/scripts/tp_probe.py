"""The host's issue time of a tensor-parallel block per micro-batch, for each recipe, over 2 local GPUs (gloo
processes on a CPU): what ``scaletool calibrate --gpus 2 --recipe R`` measures, without the rest of a calibration.

    python benchmarks/scripts/tp_probe.py OUT.json RECIPE [RECIPE ...]

OUT.json gets, per recipe, the probe's record (per mode: seconds per block as median, p10, p90 and n, the iteration
times at 1 and 3 blocks) and the calibration overheads it gives. Expected wall time on 2 H200s: about a minute a
recipe (the compiled mode compiles 1 and 3 blocks).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: tp_probe.py OUT.json RECIPE [RECIPE ...]", file=sys.stderr)
        return 2
    from scaletool.config import load_recipe
    from scaletool.errors import RecipeError
    from scaletool.predict.calibrate_tp import measure_tp_dispatch, overheads_from

    out = {}
    for name in argv[1:]:
        try:
            recipe = load_recipe(name, [])
        except RecipeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        measured = measure_tp_dispatch(recipe, 2)
        out[name] = {"measured": measured, "overheads": overheads_from(measured)}
        print(name, overheads_from(measured), flush=True)
    Path(argv[0]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
