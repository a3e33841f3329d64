"""Ablation sweeps: expand a grid over recipe keys, run every point in its own process, store results.

- :mod:`scaletool.sweep.spec`: the sweep file and its validation.
- :mod:`scaletool.sweep.points`: expansion into points, skipping invalid ones, the equal-budget solver.
- :mod:`scaletool.sweep.runner`: subprocesses with timeouts, statuses, progress, resume.
- :mod:`scaletool.sweep.store`: the append-only ``results.jsonl``.
"""
