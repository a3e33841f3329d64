"""The benchmark suite: studies as data (benchmarks/studies/*.yaml), one runner.

``python -m scaletool.bench STUDY`` runs a study's commands in order, skips those whose result exists,
and records each with the environment it ran in (:mod:`scaletool.bench.runner`); a study file lists the
commands, the recipes and the GPUs it needs (:mod:`scaletool.bench.study`).
"""
