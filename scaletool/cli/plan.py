"""``scaletool plan``: which layout to run on N GPUs, predicted, fitted, ranked, and written as commands."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from scaletool.cli.options import PositiveFloat, console, deliver, json_option, recipe_argument, set_option
from scaletool.fmt import gib, pct, si
from scaletool.measure.hardware import DEFAULT_HARDWARE

CKPT = {"none": "none", "selective": "sel", "full": "full"}
BOUND = {"compute": "compute", "memory_bandwidth": "memory", "memory bandwidth": "memory",
         "communication": "comm", "exposed_communication": "comm", "exposed communication": "comm"}


class Progress:
    """One line on stderr, rewritten in place, once the work has taken more than a second (a terminal only)."""

    def __init__(self, enabled: bool):
        self.enabled, self.start, self.shown = enabled, time.monotonic(), False

    def search(self, done: int, total: int) -> None:
        if self.enabled and time.monotonic() - self.start > 1:
            sys.stderr.write(f"\rplanning: {done}/{total} engine, parallelism and checkpointing combinations")
            sys.stderr.flush()
            self.shown = True

    def line(self, text: str) -> None:
        self.done()
        click.echo(text, err=True)

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


@click.command()
@recipe_argument
@click.option("--gpus", type=int, required=True, help="GPUs to plan for (all nodes).")
@click.option("--gpus-per-node", type=int, help="GPUs per node [default: 8, or --gpus if fewer].")
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True,
              help="The card: a profile name of `scaletool hardware` (or its file name, e.g. h200).")
@click.option("--global-batch-tokens", type=int, help="Tokens per optimizer step; accumulation reaches it "
              "[default: not fixed, accumulation 1].")
@click.option("--seq-len", type=int, help="Sequence length [default: the recipe's train.seq_len].")
@click.option("--price-per-gpu-hour", type=PositiveFloat(), help="Adds the cost per million tokens.")
@click.option("--inter-node-gb-s", type=PositiveFloat(), metavar="GB/S", help="Bus bandwidth per GPU across nodes "
              "(what `scaletool calibrate` measures over one rank per node) [default: the calibration's].")
@click.option("--calibration", metavar="NAME|PATH", help="Calibration for the predicted step: a shipped one's name "
              "or a YAML `scaletool calibrate` wrote [default: the --hardware card's].")
@click.option("--attention-variants", is_flag=True, help="Also plan the model with each other attention kind.")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Layouts listed.")
@click.option("--verify", type=click.IntRange(min=0), default=0, metavar="K",
              help="Run the best K layouts that fit this machine for a few steps; predicted vs measured, each on "
              "stderr as it finishes. Interrupted (Ctrl-C, SIGTERM): the run stops, what finished is delivered, "
              "the rest is marked not run, exit status 130.")
@click.option("--verify-out", type=click.Path(path_type=Path), metavar="DIR",
              help="Keep each verified layout's run in DIR/layout<rank> (a new or empty directory; its summary.json "
              "is what `scaletool calibrate --validate` re-predicts) [default: a temporary directory, removed].")
@set_option
@json_option
def plan(recipe: str, gpus: int, gpus_per_node: int | None, hardware: str, global_batch_tokens: int | None,
         seq_len: int | None, price_per_gpu_hour: float | None, inter_node_gb_s: float | None, calibration: str | None,
         attention_variants: bool,
         top: int, verify: int, verify_out: Path | None, overrides: tuple[str, ...], as_json: bool):
    """Plan RECIPE on --gpus GPUs: the layouts that fit, fastest first.

    \b
    Searches engine × tensor parallelism (FSDP2, in a node) × pipeline
    stages (FSDP2: pp16 1F1B, pp8i2 interleaved, pp4g GPipe) × expert
    parallelism (MoE: ep64) × micro-batch × accumulation × checkpointing
    × eager/compiled; keeps what fits the card (a pipeline's largest
    stage), ranked by the prediction `estimate` and `train` make. Each
    is a launch command; pipeline layouts show their bubble and exposed
    all-to-all, and the best with stages is set beside the best without.

    \b
    Examples:
      scaletool plan llama3-8b --gpus 8
      scaletool plan llama3-405b-dense --gpus 1024 --hardware h200 \\
          --global-batch-tokens 16777216 --price-per-gpu-hour 2.5
      scaletool plan mla-1b --gpus 16 --attention-variants --top 3
      scaletool plan deepseek-v3 --gpus 2048 --top 3
      scaletool plan tiny --gpus 2 --verify 2 --verify-out runs/verify
    """
    from scaletool import api

    prog = Progress(sys.stderr.isatty() and not as_json)
    try:
        res = api.plan(recipe, gpus=gpus, overrides=overrides, gpus_per_node=gpus_per_node, hardware=hardware,
                       global_batch_tokens=global_batch_tokens, seq_len=seq_len, price_per_gpu_hour=price_per_gpu_hour,
                       inter_node_gb_s=inter_node_gb_s, calibration=calibration,
                       attention_variants=attention_variants, top=top, verify=verify, verify_out=verify_out,
                       progress=prog.search,
                       verify_progress=prog.line)
    finally:
        prog.done()
    deliver(res, as_json)
    if not as_json:
        print_plan(res)
    if any(v.status == "not run" for v in res.verify or ()):
        raise SystemExit(130)  # interrupted: the layouts verified so far were delivered above
    return res


#: a pipeline schedule's mark in the engine column: pp16 (1F1B), pp16i2 (interleaved, 2 chunks), pp16g (GPipe)
SCHEDULE_MARK = {"1f1b": "", "gpipe": "g", "interleaved-1f1b": "i"}


def _engine(row) -> str:
    pp = ""
    if row.pipeline_parallel > 1:
        v = row.pipeline_virtual_stages
        pp = f" pp{row.pipeline_parallel}{SCHEDULE_MARK.get(row.pipeline_schedule, '?')}{v if v > 1 else ''}"
    ep = ""
    if row.expert_parallel:
        ep = f" ep{row.expert_parallel_degree or row.data_parallel}"
    return row.label + (f" tp{row.tensor_parallel}" if row.tensor_parallel > 1 else "") + pp + ep


def _bound(p) -> str:
    if p.bound.startswith("pipeline rank "):  # a pipeline layout: the stage whose work bounds the step
        return "stage " + p.bound.split()[-1]
    return BOUND.get(p.bound, p.bound)


def pipeline_lines(res) -> list[str]:
    """Per listed pipeline or expert-parallel layout, its bubble and exposed all-to-all; then the best layout
    with pipeline stages beside the best without."""
    lines = []
    for row in res.layouts:
        parts = []
        if row.pipeline:
            pl = row.pipeline
            parts.append(f"{row.pipeline_parallel}×{row.pipeline_virtual_stages} {row.pipeline_schedule}, "
                         f"m={row.pipeline_microbatches}: bubble {100 * pl['bubble_fraction']:.0f}% "
                         f"({pl['bubble_s']:.3g} s)")
        if row.expert_parallel:
            parts.append(f"all-to-all {row.exposed_all_to_all_s:.3g} s")
        if parts:
            lines.append(f"{row.rank:>2}. " + "; ".join(parts) + f"; step {row.prediction.step_s:.3g} s")
    cmp = res.pipeline_comparison
    if cmp:
        w, wo = cmp["with_pipeline"], cmp["without_pipeline"]
        lines.append(f"Best with pipeline stages #{w['rank']}, {si(w['tokens_per_s_per_gpu'])} tok/s/GPU; without "
                     f"#{wo['rank']}, {si(wo['tokens_per_s_per_gpu'])} ({cmp['speedup']:.2f}× with).")
    return lines


def layouts_table(res):
    """The top layouts, one row each; fits 80 columns (without --attention-variants and price)."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
              title_justify="left", title=f"{res.recipe} on {res.nodes} × {res.gpus_per_node} {res.hardware} "
              f"({gib(res.card_bytes)} each), T={res.seq_len}")
    variants = len({row.attention for row in res.layouts}) > 1
    cols = ["#", *(["attn"] if variants else []), "engine", "mb×acc", "ckpt", "mode", "tok/s/GPU", "MFU", "GiB",
            "free", "bound", *(["$/Mtok"] if res.price_per_gpu_hour else [])]
    for c in cols:
        t.add_column(c, justify="left" if c in ("attn", "engine", "ckpt", "mode", "bound") else "right", no_wrap=True)
    for row in res.layouts:
        p = row.prediction
        t.add_row(str(row.rank), *([row.attention] if variants else []), _engine(row),
                  f"{row.micro_batch_size}×{row.grad_accum_steps}", CKPT.get(row.activation_checkpointing, "?"),
                  "comp" if row.compiled else "eager", si(p.tokens_per_s_per_gpu) + ("*" if row.outside else ""),
                  "-" if p.mfu is None else f"{100 * p.mfu:.0f}%", f"{row.memory_bytes / 2**30:.1f}",
                  f"{row.margin_bytes / 2**30:.1f}", _bound(p),
                  *([f"{row.cost_per_million_tokens:.3g}"] if res.price_per_gpu_hour else []))
    return t


def wrapped(text: str, lead: str) -> str:
    """``text`` after ``lead``, folded at the terminal's width ($COLUMNS, else 80 when not a terminal), the
    continuation lines indented under the text; words are never split (a path or a flag stays whole)."""
    import shutil
    import textwrap

    width = max(40, shutil.get_terminal_size((80, 24)).columns)
    return textwrap.fill(text, width, initial_indent=lead, subsequent_indent=" " * min(len(lead), 4) if lead else "  ",
                         break_long_words=False, break_on_hyphens=False)


def print_plan(res) -> None:
    con = console()
    con.print(layouts_table(res))
    con.print(f"{res.fitting_layouts} layouts fit; tok/s/GPU and MFU predicted (calibration {res.calibration}); GiB: "
              "estimated peak per GPU (a pipeline's largest stage), free: what is left of the usable memory.",
              highlight=False)
    for line in pipeline_lines(res):
        con.print(line, highlight=False)
    multi = res.nodes > 1
    click.echo("\nCommands" + (" (run on every node: NODE0 is the first node's address, /shared/runs a directory "
                               "every node sees)" if multi else "") + ":")
    for row in res.layouts:
        click.echo(f"{row.rank:>2}. {row.command}")
    click.echo("\nAssumptions:")
    for line in res.assumptions:  # prose, wrapped to the terminal; the commands above stay whole (to paste)
        click.echo(wrapped(line, "  - "))
    for line in res.notes:
        click.echo(wrapped(line, "  note: "))
    c = res.considered
    click.echo(wrapped(f"searched {c['families']} engine/parallelism/checkpointing/mode combinations, "
                       f"{c['memory_estimates']} memory estimates, {c['predicted']} layouts predicted in "
                       f"{res.elapsed_s:.2f} s", ""))
    if res.verify is not None:
        print_verify(res, con)


def print_verify(res, con) -> None:
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
              title_justify="left", title="Verified here: tokens/s (all ranks), GiB per rank, predicted vs measured")
    for c in ("#", "layout", "pred", "median", "p10-p90", "n", "err", "GiB", "meas", "err"):
        t.add_column(c, no_wrap=c != "layout", justify="left" if c == "layout" else "right")
    for v in res.verify:
        m = v.measured_tokens_per_s
        spread = [si(m["median"]), f"{si(m['p10'])}-{si(m['p90'])}", str(m["n"])] if m else [v.status, "", ""]
        meas_mem = v.measured_peak_memory_bytes
        t.add_row(str(v.rank), v.layout, si(v.predicted_tokens_per_s), *spread, pct(v.rel_error_tokens_per_s, 0),
                  f"{v.predicted_memory_bytes / 2**30:.2f}", "-" if meas_mem is None else f"{meas_mem / 2**30:.2f}",
                  pct(v.rel_error_memory, 0))
    con.print(t)
    for v in res.verify:
        if v.message:
            click.echo(wrapped(v.message, f"  {v.rank}: {v.status}: "))
    for line in res.verify_notes:
        click.echo(wrapped(line, "  note: "))
