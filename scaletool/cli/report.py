"""``scaletool report``: tables, plots and findings from one or more sweep results directories."""
from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from scaletool.cli.options import deliver, json_option


@click.command()
@click.argument("results_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path),
              help="Report directory (default: <first RESULTS_DIR>/report).")
@json_option
def report(results_dirs: tuple[Path, ...], out: Path | None, as_json: bool) -> None:
    """Write report.md, a self-contained report.html and results.csv from RESULTS_DIR(s).

    \b
    Tables per mode put measured next to analytic with the relative error: parameters against
    the exact count and 12·d²·L; FLOPs from FlopCounterMode and fvcore against the closed form
    and 6·N·T; KV-cache bytes; peak memory; training tokens/s and MFU; decoding speed.
    Plots (KV bytes, parameters, tokens/s, MFU against compression ratio and FFN width; decode
    tokens/s against context) appear where the data has them; findings are computed from it.
    Several RESULTS_DIRs are compared side by side, each labelled by its sweep's `label`
    or its directory name. Example: scaletool report runs/sweeps/a100 runs/sweeps/h100 -o cmp
    """
    from scaletool.report.render import build_report

    out = out or results_dirs[0] / "report"
    res = build_report(list(results_dirs), out)
    deliver(res, as_json)
    if as_json:
        return res
    con = Console(stderr=True)
    for w in res["warnings"]:
        con.print(f"[yellow]warning:[/] {escape(w)}")
    for f in res["findings"]:
        con.print(f"• {escape(f)}")
    con.print(f"tables: {', '.join(res['tables']) or 'none'}; {len(res['plots'])} plot(s)")
    click.echo(f"report: {res['report_html']}\n        {res['report_md']}\n        {res['results_csv']}")
