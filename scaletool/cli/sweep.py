"""``scaletool sweep``: run an ablation grid, one subprocess per point and mode, resumable."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scaletool.cli.options import deliver, emit_json, json_option, set_option
from scaletool.config import parse_override
from scaletool.sweep.spec import MODES

DEFAULT_ROOT = Path("runs") / "sweeps"


@click.command()
@click.argument("sweep_file", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--out", "results_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Results directory (default runs/sweeps/<sweep name>). Rerunning into it resumes.")
@set_option
@click.option("--mode", "modes", multiple=True, type=click.Choice(MODES),
              help="Run only this mode of the sweep's modes (repeatable).")
@click.option("--retry-failed", is_flag=True, help="Rerun runs recorded as error, oom, timeout or skipped at launch.")
@click.option("--dry-run", is_flag=True, help="List the points and what a run would do; run nothing.")
@json_option
def sweep(sweep_file: str, results_dir: Path | None, overrides: tuple[str, ...], modes: tuple[str, ...],
          retry_failed: bool, dry_run: bool, as_json: bool) -> None:
    """Run SWEEP_FILE: every point of its grid in each of its modes, each in its own process.

    \b
    The sweep file names a base recipe, the dotted keys to vary (grid: a product; zip: varied
    together), the modes (estimate, count, train, decode), per-mode arguments, a per-run
    timeout, and optionally match_params to resize every point to equal parameters.
    Points that do not validate (kv_lora_rank with mha) are recorded as skipped with the reason.
    Runs end ok, oom, error or timeout; one failing never stops the others.

    \b
    Results: DIR/results.jsonl (one line per finished point and mode) and DIR/points/<point>/.
    Rerunning the same command skips what is recorded (resume after a crash or Ctrl-C);
    --retry-failed reruns the failures. Then: scaletool report DIR.
    """
    from scaletool.sweep.runner import execute, plan, to_run
    from scaletool.sweep.spec import load_sweep

    sw = load_sweep(sweep_file, [parse_override(o) for o in overrides])
    out = results_dir or DEFAULT_ROOT / sw.name
    bad = [m for m in modes if m not in sw.spec.modes]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)} not among the sweep's modes ({', '.join(sw.spec.modes)})",
                                 param_hint="--mode")
    if dry_run:
        tasks, warnings = plan(sw, out, list(modes))
        runs = {t.key for t in to_run(tasks, retry_failed)}
        rows = [{"index": t.point.index, "label": t.point.label, "mode": t.mode, "key": t.key, "state": t.state,
                 "will_run": t.key in runs and t.state != "skipped",
                 "previous_status": t.previous["status"] if t.previous else None,
                 "reason": t.point.reason, "match_params": t.point.match_params, "point_dir": t.point.dirname}
                for t in tasks]
        if as_json:
            emit_json({"sweep": sw.name, "results_dir": str(out), "warnings": warnings, "runs": rows})
        else:
            _print_plan(sw.name, out, rows, Console())
        return
    try:
        summary = execute(sw, out, retry_failed=retry_failed, modes=list(modes))
    except KeyboardInterrupt:
        click.echo(f"interrupted; finished runs are in {out / 'results.jsonl'}. Rerun the same command "
                   "to resume.", err=True)
        sys.exit(130)
    deliver(summary, as_json)
    if as_json:
        return summary
    c = summary["status_counts"]
    con = Console(stderr=True)
    con.print(", ".join(f"{n} {s}" for s, n in c.items() if n) + f" ({summary['ran_now']} run now)")
    con.print(f"results: {escape(str(out))}/results.jsonl; next: scaletool report {escape(str(out))}")


def _print_plan(name: str, out: Path, rows: list[dict], con: Console) -> None:
    t = Table(title=f"sweep {escape(name)} -> {escape(str(out))}", title_justify="left")
    for col in ("#", "point", "mode", "state", "run?", "note"):
        t.add_column(col, justify="right" if col == "#" else "left")
    for r in rows:
        note = r["reason"] or ""
        if r["match_params"]:
            mp = r["match_params"]
            note = f"{mp['key'].split('.')[-1]}={mp['value']} -> {mp['achieved']:,} params ({100 * mp['rel_error']:+.2f}%)"
        t.add_row(str(r["index"]), escape(r["label"]), r["mode"], r["state"], "yes" if r["will_run"] else "",
                  escape(note))
    con.print(t)
    n = sum(r["will_run"] for r in rows)
    con.print(f"{n} run(s) to do, {sum(r['state'] == 'done' for r in rows)} done, "
              f"{sum(r['state'] == 'skipped' for r in rows)} skipped (invalid).")
