"""``scaletool sweep``: run an ablation grid, one supervised subprocess per point, mode and repeat, resumable."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scaletool.cli.options import console, deliver, json_option, set_option
from scaletool.results.sweep import MODES


@click.command()
@click.argument("sweep_file", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--out", "results_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Results directory (default runs/sweeps/<sweep name>). Rerunning into it resumes.")
@set_option
@click.option("--mode", "modes", multiple=True, type=click.Choice(MODES),
              help="Run only this mode of the sweep's modes (repeatable).")
@click.option("--retry-failed", is_flag=True, help="Rerun runs recorded as error, oom, timeout or skipped at launch.")
@click.option("--parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at once, each on its own CPU cores and its own GPUs (with --submit slurm: array tasks at once).")
@click.option("--gpus", metavar="LIST", help="GPUs to hand out to parallel runs, e.g. 0,1,2,3 [default: "
              "CUDA_VISIBLE_DEVICES, else all that nvidia-smi lists].")
@click.option("--dry-run", is_flag=True, help="List the runs and what would run (with --submit: print the "
              "sbatch script); run nothing.")
@click.option("--submit", type=click.Choice(["slurm"]), help="Submit the missing runs as a Slurm job array instead "
              "of running them here.")
@click.option("--time", "slurm_time", metavar="TIME", help="--submit: each array task's time limit [default: the "
              "longest timeout_s plus 10 minutes].")
@click.option("--partition", help="--submit: Slurm partition.")
@click.option("--account", help="--submit: Slurm account.")
@click.option("--gpus-per-task", type=click.IntRange(min=0), help="--submit: GPUs per array task [default: the most "
              "any submitted run needs].")
@click.option("--cpus-per-task", type=click.IntRange(min=1), help="--submit: CPU cores per array task.")
@click.option("--only-task", type=click.IntRange(min=0), hidden=True)  # what each Slurm array task runs
@click.option("--plan-digest", hidden=True)
@json_option
def sweep(sweep_file: str, results_dir: Path | None, overrides: tuple[str, ...], modes: tuple[str, ...],
          retry_failed: bool, parallel: int, gpus: str | None, dry_run: bool, submit: str | None,
          slurm_time: str | None, partition: str | None, account: str | None, gpus_per_task: int | None,
          cpus_per_task: int | None, only_task: int | None, plan_digest: str | None, as_json: bool):
    """Run SWEEP_FILE: every point of its grid in each of its modes, each in its own process.

    The sweep file names a base recipe, the dotted keys to vary (grid: a product; zip: varied
    together), the modes (estimate, count, train, decode, profile), per-mode arguments, a
    per-run timeout, repeats of the timed modes, and optionally match_params (equal parameters).
    Points that do not validate are recorded as skipped with the reason. Runs end ok, oom,
    error or timeout; one failing never stops the others. Each run gets its share of the CPUs.

    Results: DIR/results.jsonl (one line per finished run) and DIR/points/<point>/<mode>/.
    Rerunning skips what is recorded (resume after a crash or kill -9); --retry-failed reruns
    the failures. One sweep at a time per DIR. Then: scaletool report DIR.

    \b
    Examples:
      scaletool sweep recipes/sweeps/mla-compression.yaml --dry-run
      # 4 GPUs, 4 points at once
      scaletool sweep recipes/sweeps/mla-compression.yaml --parallel 4
      scaletool sweep ffn-width --submit slurm --partition gpu --dry-run
    """
    from scaletool import api
    from scaletool.errors import RecipeError

    opts_given = [n for n, v in (("--time", slurm_time), ("--partition", partition), ("--account", account),
                                 ("--gpus-per-task", gpus_per_task), ("--cpus-per-task", cpus_per_task)) if v is not None]
    if opts_given and submit is None:
        raise RecipeError(f"{', '.join(opts_given)}: only with --submit slurm")
    if submit and gpus is not None:
        raise RecipeError("--gpus: Slurm allocates each array task's GPUs (see --gpus-per-task)")
    if only_task is not None:
        return _only_task(sweep_file, results_dir, overrides, only_task, plan_digest)
    if submit:
        return _submit(sweep_file, results_dir, overrides, modes, retry_failed, dry_run, as_json, parallel,
                       time=slurm_time, partition=partition, account=account, gpus_per_node=gpus_per_task,
                       cpus_per_task=cpus_per_task)
    if dry_run:
        plan = api.sweep_plan(sweep_file, out=results_dir, overrides=overrides, modes=modes, retry_failed=retry_failed)
        deliver(plan, as_json)
        if not as_json:
            print_plan(plan, console())
        return plan
    try:
        summary = api.sweep(sweep_file, out=results_dir, overrides=overrides, modes=modes, retry_failed=retry_failed,
                            parallel=parallel, gpus=gpus)
    except KeyboardInterrupt as e:
        out = results_dir or "the results directory"
        click.echo(f"{e or 'interrupted'}; every process of the running points was stopped, finished runs are in "
                   f"{out}. Rerun the same command to resume.", err=True)
        sys.exit(128 + getattr(e, "signum", 2))
    deliver(summary, as_json)
    if not as_json:
        c = summary.status_counts
        con = Console(stderr=True)
        con.print(", ".join(f"{n} {s}" for s, n in c.items() if n) + f" ({summary.ran_now} run now)", highlight=False)
        con.print(f"results: {escape(summary.results_dir)}/results.jsonl; next: scaletool report "
                  f"{escape(summary.results_dir)}", highlight=False)
    return summary


def _submit(sweep_file, results_dir, overrides, modes, retry_failed, dry_run, as_json, parallel, **slurm):
    from scaletool import api

    sub = api.sweep_submit(sweep_file, out=results_dir, overrides=overrides, modes=modes, retry_failed=retry_failed,
                           dry_run=dry_run, throttle=parallel if parallel > 1 else None, **slurm)
    if sub is None:
        click.echo("nothing to submit: every run is recorded (or still queued by an earlier submission)", err=True)
        return None
    for w in sub.warnings:
        click.echo(f"warning: {w}", err=True)
    deliver(sub, as_json)
    if dry_run and not as_json:
        click.echo(sub.script, nl=False)
    elif not as_json:
        click.echo(f"submitted job {sub.job_id}: {len(sub.tasks)} run(s) as array tasks; script {sub.script}")
        if sub.skipped_live:
            click.echo(f"({sub.skipped_live} run(s) left out: still queued or running from an earlier submission)")
    return sub


def _only_task(sweep_file, results_dir, overrides, n: int, digest: str | None):
    """One run of the plan, as a Slurm array task runs it; exit status 1 unless it ended ok (or skipped)."""
    from scaletool import api
    from scaletool.errors import RecipeError
    from scaletool.sweep.runner import execute_task

    if not digest:
        raise RecipeError("--only-task needs --plan-digest (the scripts --submit writes pass both)")
    sw = api.load_sweep(sweep_file, overrides)
    try:
        rec = execute_task(sw, api.sweep_results_dir(sw, results_dir), n, digest)
    except KeyboardInterrupt as e:
        sys.exit(128 + getattr(e, "signum", 2))
    if rec is not None and rec.status not in ("ok", "skipped"):
        sys.exit(1)
    return rec


def _group(runs) -> list[list]:
    """Runs of one (point, mode) together, at the place of the first: repeats share a table row, also where
    they run round the points (every first run, then every second: a sweep's ``repeats``)."""
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r.index, r.mode), []).append(r)
    return list(groups.values())


def _state(group) -> str:
    states = [r.state for r in group]
    if len(set(states)) == 1:
        return states[0]
    return ", ".join(f"{states.count(s)} {s}" for s in ("done", "failed", "pending") if s in states)


def _note(r) -> str:
    if r.match_params:
        mp = r.match_params
        return f"{mp['key'].split('.')[-1]}={mp['value']} -> {mp['achieved']:,} params ({100 * mp['rel_error']:+.2f}%)"
    return r.reason or ""


def print_plan(plan, con: Console) -> None:
    """The plan as a table that fits the terminal: long labels and notes fold; every detail is in --json."""
    groups = _group(plan.runs)
    notes = [_note(g[0]) for g in groups]
    t = Table(title=f"sweep {escape(plan.sweep)} -> {escape(plan.results_dir)}", title_justify="left")
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("point", overflow="fold")
    t.add_column("mode", no_wrap=True)
    t.add_column("state", overflow="fold")
    t.add_column("run?", no_wrap=True)
    if any(notes):
        t.add_column("note", overflow="fold")
    for group, note in zip(groups, notes):
        r = group[0]
        n_run = sum(x.will_run for x in group)
        run = ("yes" if n_run else "") if len(group) == 1 else (f"{n_run}/{len(group)}" if n_run else "")
        mode = r.mode if r.repeats == 1 else f"{r.mode} ×{r.repeats}"
        t.add_row(str(r.index), escape(r.label), mode, _state(group), run, *([escape(note)] if any(notes) else []))
    for w in plan.warnings:
        con.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    con.print(t)
    runs = plan.runs
    con.print(f"{sum(r.will_run for r in runs)} run(s) to do, {sum(r.state == 'done' for r in runs)} done, "
              f"{sum(r.state == 'skipped' for r in runs)} skipped (invalid).", highlight=False)
