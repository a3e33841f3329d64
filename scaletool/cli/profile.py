"""``scaletool profile``: train with ``torch.profiler`` on, then print the operator breakdown."""
from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from scaletool.cli.options import deliver, json_option, recipe_argument, set_option


def parse_ranks(ctx, param, text: str | None) -> str | list[int] | None:
    """``all`` or ``0,2,3`` -> ``"all"`` or the ranks (a click callback: checked before anything runs)."""
    if text is None:
        return None
    if text.strip() == "all":
        return "all"
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected 'all' or comma-separated ranks such as 0,1",
                                 param_hint="--ranks") from None
    if not ranks or ranks[0] < 0:
        raise click.BadParameter(f"{text!r}: expected 'all' or comma-separated ranks >= 0", param_hint="--ranks")
    return ranks


@click.command(context_settings={"show_default": True})
@recipe_argument
@set_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Run directory [default: runs/<recipe>-<timestamp>]; traces go to <out>/profile/traces, the "
                   "breakdown to <out>/profile/breakdown.json.")
@click.option("--ranks", default=None, metavar="all|R[,R...]", callback=parse_ranks,
              help="Ranks that profile (profile.ranks) [default: the recipe's, normally all].")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Start this many local ranks with torchrun, "
              "as `scaletool train --nproc-per-node` does.")
@click.option("--monitors/--no-monitors", default=None, help="Training-dynamics monitors (profile.monitors.enabled) "
              "[default: the recipe's].")
@json_option
def profile(recipe: str, overrides: tuple[str, ...], out: Path | None, ranks: str | None, nproc_per_node: int | None,
            monitors: bool | None, as_json: bool):
    """Train RECIPE with torch.profiler on, then break each step's time down by operator.

    The schedule is profile.wait, .warmup, .active, .repeat (steps); each profiled rank writes
    <out>/profile/traces/rank<R>.<ts>.pt.trace.json.gz, which Perfetto (ui.perfetto.dev),
    chrome://tracing and tensorboard (pip install 'scaletool[profile]') open.
    profile.memory_snapshot adds a CUDA memory snapshot.

    The breakdown (printed, and saved as <out>/profile/breakdown.json) gives the share of the
    step spent in attention (SDPA kernels/ops), FFN matmuls, other matmuls, norms, the optimizer,
    exposed communication (NCCL/gloo collectives) and idle, which add up to the step time; the
    top operators or kernels by self time; and how much communication overlapped compute.

    \b
    Examples:
      scaletool profile recipes/tiny.yaml
      scaletool profile tiny --nproc-per-node 2 --set parallel.engine=fsdp \\
          --ranks 0,1
      scaletool profile mla-1b --set profile.wait=5 --set train.steps=10 --json
    """
    import signal
    import sys

    from scaletool import api
    from scaletool.cli.train import default_out
    from scaletool.fmt import stdout_to_stderr
    from scaletool.launch.failures import reported_failures
    from scaletool.train.trainer import TrainFailed, stop_on_signals, stop_signal

    out = out or default_out(recipe)
    with reported_failures(), stop_on_signals():
        try:
            with stdout_to_stderr(as_json):  # the training log and the ranks' prints; stdout keeps the JSON
                report = api.profile(recipe, overrides=overrides, out=out, quiet=as_json, monitors=monitors,
                                     ranks=ranks,
                                     nproc_per_node=nproc_per_node)
        except TrainFailed as failed:
            sig = stop_signal()
            if sig is not None:  # a stop, not a failure: train's one line, without the resume (a profile is rerun)
                click.echo(failed.lines[0] if failed.lines else f"stopped by {signal.Signals(sig).name}", err=True)
                sys.exit(128 + sig)
            for line in failed.lines:
                click.echo(f"error: {line}", err=True)
            sys.exit(1)
    if report is not None:  # None: not rank 0 of a launched run
        deliver(report, as_json)
        if not as_json:
            console = Console(soft_wrap=True)  # paths and notes stay on one line when piped
            if monitors:
                _print_monitors(out, console)
            from scaletool.profile.trace import BREAKDOWN_FILE, profile_dir  # torch: only once the command runs

            print_breakdown(report.model_dump(mode="json"), console, profile_dir(out) / BREAKDOWN_FILE)
    from scaletool.engines.dist import end_worker_process, launcher_env

    le = launcher_env()
    if le["launched"] and le["world_size"] > 1:
        end_worker_process()  # as train's ranks: DeepSpeed over gloo can abort in the native teardown
    return report


def _print_monitors(out: Path, console: Console) -> None:
    """What the training-dynamics monitors found (summary.json's dynamics section)."""
    import json

    dyn = json.loads((out / "summary.json").read_text()).get("dynamics") or {}
    steps = dyn.get("steps") or []
    warnings = dyn.get("warnings") or []
    console.print(f"monitors: measured after steps {', '.join(map(str, steps)) or 'none'}; "
                  f"{len(warnings) or 'no'} collapse warning{'s' if len(warnings) != 1 else ''}; history in "
                  f"{out / 'summary.json'} (dynamics) and {out / 'metrics.jsonl'}")
    for w in warnings:
        console.print(w, style="yellow", markup=False)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_breakdown(report: dict, console: Console, path: Path | None = None) -> None:
    """The breakdown as rich tables: categories, modules, top operators, communication overlap."""
    from scaletool.profile.breakdown import ALL_CATEGORIES, ALL_MODULES

    rec = report.get("recipe", {})
    console.print(f"[bold]{rec.get('attention', '?').upper()}[/] d_model={rec.get('d_model')} "
                  f"n_layers={rec.get('n_layers')} ffn={rec.get('ffn')}×{rec.get('intermediate_size')} "
                  f"engine={rec.get('engine')} on {report['device']}, ranks {report['ranks']}, "
                  f"{report['n_steps']} profiled steps")
    console.print(f"step time {_ms(report['step_time_s'])} ms from the trace, {_ms(report.get('loop_step_time_s'))} "
                  "ms by the loop's clock (both with the profiler's overhead)")
    for key, title, labels in (("categories", "By operator", ALL_CATEGORIES), ("modules", "By module", ALL_MODULES)):
        t = Table(title=f"{title} (ms per step)", title_justify="left")
        t.add_column(""), t.add_column("ms", justify="right"), t.add_column("share", justify="right")
        for name in labels:
            v = report[key][name]
            t.add_row(name, _ms(v["time_s"]), _pct(v["share"]))
        console.print(t)
    t = Table(title="Top operators / kernels by self time", title_justify="left")
    for c in ("name", "category", "calls/step", "ms", "share"):
        t.add_column(c, justify="left" if c in ("name", "category") else "right")
    for op in report["top_ops"][:12]:
        t.add_row(op["name"][:70], op["category"], f"{op['calls']:g}", _ms(op["time_s"]), _pct(op["share"]))
    console.print(t)
    c = report["communication_overlap"]
    if c["communication_s"]:
        console.print(f"communication {_ms(c['communication_s'])} ms/step, {_pct(c['overlap_ratio'])} overlapped "
                      f"with compute, {_ms(c['exposed_s'])} ms exposed")
    for note in report.get("notes", []):
        console.print(f"note: {note}", style="yellow")
    if path is not None:
        console.print(f"saved {path}; traces in {path.parent / 'traces'}")
