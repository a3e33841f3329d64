"""Where tensor parallelism wins on one 2-GPU host: llama3-8b at T=8192 with L layers and a micro-batch
chosen from the analytic estimate so that FSDP2 without activation checkpointing exceeds this card's memory
and TP=2 without it fits; then one ``scaletool train --json`` of the named layout, its JSON on stdout with
the choice added under ``"win"``.

    python benchmarks/scripts/tp_win.py LAYOUT --out DIR     # LAYOUT: fsdp-fullac | tp2-noac | fsdp-noac

fsdp-noac is expected to be refused (it does not fit): its exit status is the run's. ``--cpu`` runs the
tiny recipe on CPU instead (a check of this script, no choice to make).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

LAYOUTS = {
    "fsdp-fullac": ["parallel.tensor_parallel=1", "train.activation_checkpointing=full"],
    "tp2-noac": ["parallel.tensor_parallel=2", "train.activation_checkpointing=none"],
    "fsdp-noac": ["parallel.tensor_parallel=1", "train.activation_checkpointing=none", "train.steps=3",
                  "train.measure_warmup_steps=1"],
}


def choose() -> tuple[int, int]:
    """The smallest L (then micro-batch) where FSDP2 needs checkpointing on this card and TP=2 does not."""
    import torch

    from scaletool.analytic.memory import tensor_parallel_memory
    from scaletool.config import load_recipe
    cap = torch.cuda.get_device_properties(0).total_memory

    def est(L, mb, tp, ac):
        r = load_recipe("recipes/llama3-8b.yaml", ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}",
                        "parallel.world_size=2", f"model.n_layers={L}", f"train.micro_batch_size={mb}",
                        f"train.activation_checkpointing={ac}"])
        return tensor_parallel_memory(r, 2, tp)["total_bytes"]
    return next(((L, mb) for mb in (1, 2, 4) for L in range(8, 33, 2)
                 if est(L, mb, 1, "none") > 1.02 * cap and est(L, mb, 2, "none") < 0.85 * cap), (24, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", choices=sorted(LAYOUTS))
    p.add_argument("--out", required=True, help="the run's output directory")
    p.add_argument("--cpu", action="store_true", help="tiny recipe on CPU (checks this script)")
    a = p.parse_args()
    if a.cpu:
        L, mb, base = 2, 2, ["recipes/tiny.yaml", "--set", "train.steps=4", "--set", "train.measure_warmup_steps=1"]
    else:
        L, mb = choose()
        base = ["recipes/llama3-8b.yaml", "--set", "train.compile=false", "--set", "train.steps=10",
                "--set", "train.measure_warmup_steps=3", "--set", "train.log_every=5"]
    sets = ["parallel.engine=fsdp", f"model.n_layers={L}", f"train.micro_batch_size={mb}", *LAYOUTS[a.layout]]
    cmd = [sys.executable, "-m", "scaletool", "train", *base, *[x for s in sets for x in ("--set", s)],
           "--out", a.out, "--nproc-per-node", "2", "--json"]
    print(f"tp_win: {a.layout}: llama3-8b, {L} layers, micro-batch {mb}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    try:
        d = json.loads(proc.stdout)
    except ValueError:
        sys.stdout.write(proc.stdout)
        return proc.returncode or 1
    d["win"] = {"layout": a.layout, "n_layers": L, "micro_batch_size": mb, "command": cmd[1:]}
    print(json.dumps(d, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
