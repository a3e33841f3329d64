"""Tensor parallelism against FSDP2 alone: the analytic table before the runs, the measured table after.

    python recipes/benchmarks/tp_table.py analytic mha-1b mla-1b   # peak memory and bytes on the wire per GPU
    python recipes/benchmarks/tp_table.py table OUT                 # OUT holds the tp study's results

Layouts: fsdp-x2 (2 GPUs), tp2, fsdp-x4, tp4, 2x2 (FSDP2 x TP=2). Regimes: rank8, 8 sequences per
data-parallel rank; global8, the same global batch of 8 sequences for every layout.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LAYOUTS = {"fsdp-x2": (2, 1), "tp2": (2, 2), "fsdp-x4": (4, 1), "tp4": (4, 4), "2x2": (4, 2)}


def analytic(recipes: list[str]) -> None:
    from scaletool import analytic as an
    from scaletool.config import load_recipe
    from scaletool.fmt import gib
    for recipe in recipes:
        for regime in ("rank8", "global8"):
            for name, (world, tp) in LAYOUTS.items():
                mb = 8 if regime == "rank8" else 8 * tp // world
                r = load_recipe(f"recipes/{recipe}.yaml", ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}",
                                                            f"train.micro_batch_size={mb}", "train.compile=false"])
                mem = an.tensor_parallel_memory(r, world, tp)
                c = an.communication(r, world, tp)
                print(f"{recipe:7} {regime:7} {name:7} mb={mb} peak={gib(mem['total_bytes'])} "
                      f"act={gib(mem['activations_bytes'])} wire/GPU/step tp={gib(c['tp_wire_bytes'])} "
                      f"dp={gib(c['dp_wire_bytes'])}")


def _load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def table(out: Path) -> None:
    runs = {}
    for p in sorted(out.glob("*-rank8-*.json")) + sorted(out.glob("*-global8-*.json")):
        recipe, regime = re.match(r"(.+)-(rank8|global8)-", p.stem).groups()
        runs[p.stem] = (recipe, regime, _load(p))
    ok = {k: v for k, v in runs.items() if v[2] and v[2].get("status") == "completed"}
    per_gpu = {k: d["metrics"]["throughput/tokens_per_s_per_gpu"] for k, (_, _, d) in ok.items()}
    base = {(r, g, d["environment"]["world_size"]): per_gpu[k] for k, (r, g, d) in ok.items()
            if d["recipe"]["parallel"]["tensor_parallel"] == 1}
    print(f"{'run':34} {'GPUs':>4} {'TP':>3} {'mb':>3} {'tok/s/GPU':>10} {'vs fsdp':>8} "
          f"{'peak GiB':>9} {'est GiB':>8} {'rel':>7}")
    for k, (recipe, regime, d) in runs.items():
        if k not in ok:
            print(f"{k:34} failed or missing")
            continue
        m, world = d["metrics"], d["environment"]["world_size"]
        ref = base.get((recipe, regime, world))
        rel = m["memory/analytic_rel_error"]
        print(f"{k:34} {world:>4} {d['recipe']['parallel']['tensor_parallel']:>3} {d['recipe']['train']['micro_batch_size']:>3} "
              f"{per_gpu[k]:>10.0f} {(per_gpu[k] / ref if ref else float('nan')):>8.2f} "
              f"{(d['peak_memory_bytes'] or 0) / 2**30:>9.2f} {m['memory/analytic_bytes'] / 2**30:>8.2f} "
              f"{(rel if rel is not None else float('nan')):>+7.1%}")
    print("\nprofiler, rank 0 (share of the step; exposed = not overlapped by compute)")
    for p in sorted(out.glob("profile-*.json")):
        d = _load(p)
        if not d or not d.get("step_time_s"):
            print(f"{p.stem}: no breakdown")
            continue
        co, step = d["communication_overlap"], d["step_time_s"]
        print(f"{p.stem:26} step {1e3 * step:7.1f} ms  communication {1e3 * co['communication_s']:6.1f} ms "
              f"({co['communication_s'] / step:.1%}), exposed {co['exposed_s'] / step:.1%}, "
              f"overlap ratio {co['overlap_ratio']}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "analytic":
        analytic(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        table(Path(sys.argv[2]))
    else:
        sys.exit("usage: tp_table.py analytic RECIPE... | tp_table.py table OUT")
