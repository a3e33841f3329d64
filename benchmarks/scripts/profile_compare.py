"""The operator breakdowns of several `scaletool profile` runs side by side.

    python benchmarks/scripts/profile_compare.py OUT   # OUT/<name>.json: each run's profile/breakdown.json

Prints the step time (trace and loop clock), the share of each category and module, and each run's top
kernels.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def compare(out: Path) -> None:
    runs = {}
    for p in sorted(out.glob("*-*.json")):
        try:
            runs[p.stem] = json.loads(p.read_text())
        except ValueError:
            print(f"{p.name}: no breakdown")
    names = list(runs)
    print("step time (ms, trace / loop clock): " + ", ".join(
        f"{n} {1e3 * r['step_time_s']:.1f} / {1e3 * (r['loop_step_time_s'] or 0):.1f}" for n, r in runs.items()))
    for key in ("categories", "modules"):
        labels = list(next(iter(runs.values()))[key]) if runs else []
        print(f"\n{key} (share of step, ms)")
        print(f"{'':15}" + "".join(f"{n:>24}" for n in names))
        for lab in labels:
            print(f"{lab:15}" + "".join(
                f"{100 * (runs[n][key][lab]['share'] or 0):>14.1f}% {1e3 * runs[n][key][lab]['time_s']:>7.2f}"
                for n in names))
    for n, r in runs.items():
        print(f"\n{n}: top kernels")
        for op in r["top_ops"][:8]:
            print(f"  {100 * op['share']:5.1f}%  {op['category']:13} {op['name'][:100]}")
        for note in r.get("notes", []):
            print(f"  note: {note}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: profile_compare.py OUT")
    compare(Path(sys.argv[1]))
