"""``scaletool count``: build the model and measure parameters and FLOPs against the analytic model."""
from __future__ import annotations

import click
from rich import box
from rich.console import Console
from rich.table import Table

from scaletool import api
from scaletool.cli.options import console, deliver, json_option, recipe_argument, set_option
from scaletool.fmt import gib, pct, si


@click.command()
@recipe_argument
@set_option
@click.option("--device", type=click.Choice(["meta", "cpu", "cuda"]), default="meta", show_default=True,
              help="Where to build the model: meta allocates no weights (any size); cpu and cuda run real "
                   "kernels, after checking that the count's memory fits.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences per counted batch.")
@click.option("--no-fvcore", is_flag=True, help="Skip fvcore (FlopCounterMode only).")
@json_option
def count(recipe: str, overrides: tuple[str, ...], device: str, batch: int, no_fvcore: bool, as_json: bool):
    """Measure parameters and FLOPs of RECIPE's model; print them next to the closed forms.

    Parameters are summed over the built module; FLOPs come from torch's FlopCounterMode (forward
    and forward+backward) and from fvcore (forward). Both count all T² attention scores, so they are
    compared with the analytic 'full' convention; the causal (MFU) convention is shown beside.
    On cpu or cuda the memory the count needs (fp32 weights, gradients, one batch's activations)
    is estimated first; a count that would not fit is refused with the figures.

    \b
    Examples:
      scaletool count recipes/mla-1b.yaml
      scaletool count recipes/tiny.yaml --device cpu --batch 4
      scaletool count recipes/deepseek-v3.yaml --no-fvcore --json | jq .params
    """
    r = api.resolve(recipe, overrides)
    res = api.count(r, device=device, batch=batch, fvcore=not no_fvcore)
    deliver(res, as_json)
    if not as_json:
        print_count(r, res, console())
    return res


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 padding=(0, 1), collapse_padding=True)


def print_count(r, res, con: Console) -> None:
    """Two tables that fit 80 columns (details, e.g. fvcore's per-operator split, are in --json)."""
    p = res.params
    t = _table(f"Parameters ({r.model.attention}, built on {res.device})")
    for c in ("", "measured", "exact", "rel. error"):
        t.add_column(c, justify="left" if not c else "right", no_wrap=True)
    t.add_row("total", f"{p.measured:,}", f"{p.total:,}", pct(p.rel_error, 4))
    if p.active != p.total:
        t.add_row("active per token (MoE)", "", f"{p.active:,}", "")
    con.print(t)
    # the rule of thumb is neither measured nor exact: a line of its own, each figure named
    con.print(f"rule of thumb 12·d²·L = {p.rule_of_thumb_12d2L:,}\n"
              f"  against {p.non_embedding:,} non-embedding (exact): {pct(p.rule_of_thumb_rel_error)}", soft_wrap=True)
    f = res.flops
    a = f.analytic
    t = _table(f"FLOPs for {f.tokens:,} tokens (batch {res.batch} × seq_len {res.seq_len})")
    for c in ("counter", "pass", "measured", "analytic (full)", "rel. error"):
        t.add_column(c, justify="left" if c in ("counter", "pass") else "right", no_wrap=True)
    fc = f.flop_counter
    t.add_row("FlopCounterMode", "fwd", si(fc.forward, "FLOP", 5), si(a["forward_full"], "FLOP", 5),
              pct(fc.forward_rel_error, 4))
    t.add_row("FlopCounterMode", "fwd+bwd", si(fc.train, "FLOP", 5), si(a["train_full"], "FLOP", 5),
              pct(fc.train_rel_error, 4))
    if f.fvcore is not None:
        t.add_row("fvcore (MACs × 2)", "fwd", si(f.fvcore.forward, "FLOP", 5), si(a["forward_full"], "FLOP", 5),
                  pct(f.fvcore.forward_rel_error, 4))
    t.add_row("analytic causal", "fwd+bwd", "", si(a["train_causal"], "FLOP", 5), "")
    t.add_row("analytic 6·N·T", "fwd+bwd", "", si(a["train_6N"], "FLOP", 5), "")
    con.print(t)
    for note in f.notes:
        con.print(f"• {note}")
    if res.memory is not None:
        m = res.memory
        avail = f", {gib(m.available_bytes)} available ({m.available_source})" if m.available_bytes is not None else ""
        con.print(f"• Memory: the count needed about {gib(m.required_bytes)} on {res.device} (estimated before "
                  f"building){avail}.")
