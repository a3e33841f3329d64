"""Fit the clock-power curve behind ``scaletool.analytic.power`` to the committed power/clock records.

Usage (any machine, repo root; a second):
    python benchmarks/scripts/power_fit.py
    python benchmarks/scripts/power_fit.py benchmarks/results/power/h200-2026-11-28 --json

Every GEMM point of ``power_clock.py`` (a workload ``w``: one call's operand type; ``n`` SMs; the median SM clock
``f`` and board power ``P``) is fitted to ``P = P0 + c_w * n**alpha * (f / f_max)**k``: ``c_w`` by least squares
for each (k, alpha) of a grid, ``P0`` with them but held at or above the card's idle draw (a board at full
clock draws at least what it draws idle). The best (k, alpha, P0) by rms, and the clock a 500 W limit leaves of
the 700 W one, ``((0.985 * 500 - P0) / (0.985 * 700 - P0)) ** (1 / k)``, for it and for every fit whose rms is
within 10% of the best (the spread the data leave).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "power"
DRAW_SHARE = 0.985


def points(folders: list[Path]) -> tuple[list[tuple], float, float]:
    """(workload, n, f MHz, P W) of every GEMM point; the highest clock; the lowest idle draw."""
    from scaletool import records

    pts, fmax, idle = [], 0.0, float("inf")
    for folder in folders:
        for line in records.read_record(folder / "power-clock.jsonl").splitlines():
            r = json.loads(line)
            if r["part"] == "card":
                fmax = max(fmax, float(r["max_sm_clock_mhz"]))
            elif r["part"] == "idle":
                idle = min(idle, r["power_w"]["median"])
            elif r["part"] == "sms" and "error" not in r:
                pts.append((f"{folder.name}:{r.get('dtype', 'bf16')}", r["sms"], r["clock_mhz"]["median"],
                            r["power_w"]["median"]))
    return pts, fmax, idle


def _fit(pts, fmax: float, k: float, alpha: float, floor: float):
    import numpy as np

    groups = sorted({p[0] for p in pts})
    x = np.array([[p[1] ** alpha * (p[2] / fmax) ** k * (p[0] == g) for g in groups] for p in pts])
    y = np.array([p[3] for p in pts])
    free = np.linalg.lstsq(np.hstack([np.ones((len(pts), 1)), x]), y, rcond=None)[0]
    p0 = free[0]
    if p0 < floor:  # the bound binds: refit the workloads' coefficients with P0 on it
        p0, c = floor, np.linalg.lstsq(x, y - floor, rcond=None)[0]
    else:
        c = free[1:]
    rms = float(np.sqrt(np.mean((p0 + x @ c - y) ** 2)))
    return rms, float(p0), dict(zip(groups, (float(v) for v in c)))


def ratio(p0: float, k: float, limit: float = 500.0, reference: float = 700.0) -> float:
    return ((DRAW_SHARE * limit - p0) / (DRAW_SHARE * reference - p0)) ** (1.0 / k)


def fit(folders: list[Path]) -> dict:
    pts, fmax, idle = points(folders)
    grid = []
    for i in range(100, 401, 5):
        for j in range(50, 101, 2):
            k, alpha = i / 100, j / 100
            rms, p0, c = _fit(pts, fmax, k, alpha, idle)
            grid.append((rms, k, alpha, p0, c))
    grid.sort(key=lambda g: g[0])
    rms, k, alpha, p0, c = grid[0]
    near = [ratio(g[3], g[1]) for g in grid if g[0] <= 1.1 * rms]
    return {"points": len(pts), "f_max_mhz": fmax, "idle_w": idle, "k": k, "alpha": alpha, "static_w": round(p0, 1),
            "rms_w": round(rms, 1), "per_sm_w": c, "clock_ratio_500_of_700": round(ratio(p0, k), 3),
            "clock_ratio_500_of_700_near_fits": [round(min(near), 3), round(max(near), 3), len(near)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", type=Path, help="power/clock run folders (default: every one committed)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    folders = a.folders or sorted(p for p in RESULTS.iterdir() if p.is_dir())
    try:
        out = fit(folders)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        lo, hi, n = out["clock_ratio_500_of_700_near_fits"]
        print(f"{out['points']} points: P = {out['static_w']} W + c_w n^{out['alpha']} (f/{out['f_max_mhz']:g})^{out['k']} "
              f"(rms {out['rms_w']} W; P0 held >= idle {out['idle_w']} W)")
        print(f"clock at a 500 W limit over the 700 W one: {out['clock_ratio_500_of_700']} ({lo}-{hi} over the {n} fits "
              "within 10% of the best rms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
