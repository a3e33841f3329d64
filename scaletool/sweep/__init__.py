"""Ablation sweeps: expand a grid over recipe keys, run every point in its own process, store results.

- :mod:`scaletool.sweep.spec`: the sweep file and its validation.
- :mod:`scaletool.sweep.points`: expansion into points, skipping invalid ones, refusing duplicates, the
  equal-budget solver.
- :mod:`scaletool.sweep.runner`: the plan (point, mode, repeat), running it, records, resume.
- :mod:`scaletool.sweep.pool`: runs at once, each on its own cores and GPUs, with timeouts.
- :mod:`scaletool.sweep.supervise`: the per-run supervisor that takes everything a run started down with it.
- :mod:`scaletool.sweep.lock`: one sweep per results directory.
- :mod:`scaletool.sweep.store`: the append-only ``results.jsonl``, validated on read.
- :mod:`scaletool.sweep.progress`: a progress bar on a terminal, plain lines elsewhere.
- :mod:`scaletool.sweep.slurm`: a sweep submitted as a Slurm job array.
"""
