"""``scaletool quickstart``: the CPU demo, a small MLA-versus-MHA sweep and its report."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import click
from rich.markup import escape

from scaletool.cli.options import console

#: untimed runs (estimate, count) at once: they measure no time, so they may share the cores
UNTIMED_PARALLEL = 4


@click.command()
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/quickstart"),
              show_default=True, help="Results directory; the report goes to OUT/report. Rerunning resumes.")
@click.option("--sweep", "sweep_file", default="quickstart", show_default=True,
              help="Run another sweep the same way: a sweep file, or the name of a shipped one (mla-compression).")
def quickstart(out: Path, sweep_file: str) -> None:
    """Sweep MLA against MHA on a tiny decoder on the CPU, then write the report.

    Runs the shipped sweep `quickstart` (recipes/quickstart.yaml): compression ratios (kv_lora_rank)
    and FFN widths, each point in estimate and count (several at once: nothing is timed) and then in
    train three times (one run at a time, on all the cores, 20+ measured steps each; all first runs,
    then all second, then all third, so the findings are judged by each point's spread across its
    runs). Under 3 minutes on two quiet cores, under 6 beside other jobs; no GPU. Ends by printing where
    report.html and report.md are. Rerunning resumes; delete OUT to start over.

    \b
    Examples:
      scaletool quickstart
      scaletool quickstart --out runs/qs2 --sweep my-sweep.yaml
    """
    from scaletool import api, threads
    from scaletool.results.sweep import TIMED_MODES

    con = console(stderr=True)
    sw = api.load_sweep(sweep_file)
    con.print(f"[bold]scaletool quickstart[/]: {escape(sw.spec.description or sw.name)} -> {escape(str(out))}")
    untimed = [m for m in sw.spec.modes if m not in TIMED_MODES]
    timed = [m for m in sw.spec.modes if m in TIMED_MODES]
    counts: Counter[str] = Counter()
    try:
        for modes, parallel in ((untimed, min(UNTIMED_PARALLEL, threads.available_cores())), (timed, 1)):
            if modes:
                summary = api.sweep(sw.path, out=out, modes=modes, parallel=parallel, console=con)
                counts.update({s: n for s, n in summary.status_counts.items() if n})
    except KeyboardInterrupt as e:
        again = f" --sweep {sweep_file}" if sweep_file != "quickstart" else ""
        click.echo(f"interrupted; rerun `scaletool quickstart --out {out}{again}` to resume.", err=True)
        sys.exit(128 + getattr(e, "signum", 2))
    con.print(", ".join(f"{n} {s}" for s, n in counts.items()), highlight=False)
    res = api.report([out], out / "report")
    for f in res.findings:
        con.print(f"• {escape(f)}", highlight=False)
    click.echo(f"\nreport: {res.report_html}\n        {res.report_md}")
