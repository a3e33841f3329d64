"""The comparative report over one or more sweep results directories.

- :mod:`scaletool.report.data`: results dirs read back through typed views into rows (one per point
  and mode, its repeats together).
- :mod:`scaletool.report.tables`: one table per mode, measured next to analytic with relative errors,
  timed figures as median, p10–p90 and n.
- :mod:`scaletool.report.claims`: the price transformer's stated attention-memory claim,
  checked when the data has that model.
- :mod:`scaletool.report.plots`: matplotlib (Agg) plots with p10–p90 error bars, drawn only where the
  data has two x values.
- :mod:`scaletool.report.dynamics`: the training-dynamics study, for monitored train runs: outcomes,
  loss, entropy and effective-rank curves; :mod:`scaletool.report.dynamics_findings`: the stated
  training-dynamics claims judged against the data.
- :mod:`scaletool.report.findings`: sentences computed from the data; throughput differences only
  beyond the noise.
- :mod:`scaletool.report.results_csv`: results.csv from the typed rows.
- :mod:`scaletool.report.render`: report.md, self-contained report.html (jinja2, autoescaped), and the
  :class:`~scaletool.results.report.ReportResult` that ``api.report`` returns.
"""
