"""``scaletool quickstart``: the CPU demo, a small MLA-versus-MHA sweep and its report."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from scaletool.cli.options import console


@click.command()
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/quickstart"),
              show_default=True, help="Results directory; the report goes to OUT/report. Rerunning resumes.")
@click.option("--sweep", "sweep_file", default="quickstart", show_default=True,
              help="Run another sweep the same way: a sweep file, or the name of a shipped one (mla-compression).")
def quickstart(out: Path, sweep_file: str) -> None:
    """Sweep MLA against MHA on a tiny decoder on the CPU, then write the report.

    \b
    Runs the shipped sweep `quickstart` (recipes/quickstart.yaml): compression ratios (kv_lora_rank)
    and FFN widths, each point in estimate, count and a few train steps, one process per run. A
    couple of minutes on two cores, no GPU. Ends by printing where report.html and report.md are.
    Delete OUT to start over.

    \b
    Examples:
      scaletool quickstart
      scaletool quickstart --out runs/qs2 --sweep my-sweep.yaml
    """
    from scaletool import api
    from scaletool.sweep.runner import execute
    from scaletool.sweep.spec import load_sweep

    con = console(stderr=True)
    sw = load_sweep(sweep_file)
    con.print(f"[bold]scaletool quickstart[/]: {escape(sw.spec.description or sw.name)} -> {escape(str(out))}")
    try:
        summary = execute(sw, out)
    except KeyboardInterrupt:
        again = f" --sweep {sweep_file}" if sweep_file != "quickstart" else ""
        click.echo(f"interrupted; rerun `scaletool quickstart --out {out}{again}` to resume.", err=True)
        sys.exit(130)
    counts = summary["status_counts"]
    con.print(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    res = api.report([out], out / "report")
    for f in res.findings:
        con.print(f"• {escape(f)}")
    click.echo(f"\nreport: {res.report_html}\n        {res.report_md}")
