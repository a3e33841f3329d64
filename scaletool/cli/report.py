"""``scaletool report``: tables, plots and findings from one or more sweep results directories."""
from __future__ import annotations

from pathlib import Path

import click

from scaletool.cli.options import deliver, json_option


@click.command()
@click.argument("results_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path),
              help="Report directory (default: <first RESULTS_DIR>/report).")
@json_option
def report(results_dirs: tuple[Path, ...], out: Path | None, as_json: bool):
    """Write report.md, a self-contained report.html and results.csv from RESULTS_DIR(s).

    Tables per mode put measured next to analytic with the relative error: parameters against
    the exact count and 12·d²·L; FLOPs from FlopCounterMode and fvcore against the closed form
    and 6·N·T; KV-cache bytes and compression (against the same-head-dims MHA and against the
    MHA point swept); peak memory; training tokens/s (median, p10–p90, n) and MFU in both
    conventions; decode and prefill tokens/s. Plots carry p10–p90 error bars. Findings state a
    difference only beyond the noise. A point run several times (sweep `repeats`) is one row,
    the median across its runs. Several RESULTS_DIRs are compared side by side, each labelled
    by its sweep's `label` or its directory name.

    \b
    Examples:
      scaletool report runs/quickstart
      scaletool report runs/sweeps/a100 runs/sweeps/h100 -o reports/cmp --json
    """
    from rich.console import Console
    from rich.markup import escape

    from scaletool import api

    res = deliver(api.report(results_dirs, out), as_json)
    if as_json:
        return res
    con = Console(stderr=True)
    for w in res.warnings:
        con.print(f"[yellow]warning:[/] {escape(w)}")
    for f in res.findings:
        con.print(f"• {escape(f)}")
    con.print(f"tables: {', '.join(res.tables) or 'none'}; {len(res.plots)} plot(s)")
    click.echo(f"report: {res.report_html}\n        {res.report_md}\n        {res.results_csv}")
    return res
