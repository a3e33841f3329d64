"""The comparative report over one or more sweep results directories.

- :mod:`scaletool.report.data`: results dirs read back into rows (latest record per key).
- :mod:`scaletool.report.tables`: one table per mode, measured next to analytic with relative errors.
- :mod:`scaletool.report.plots`: matplotlib (Agg) plots, drawn only where the data has two x values.
- :mod:`scaletool.report.findings`: sentences computed from the data.
- :mod:`scaletool.report.render`: report.md, self-contained report.html (jinja2, autoescaped), results.csv.
"""
