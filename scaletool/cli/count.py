"""``scaletool count``: build the model and measure parameters and FLOPs against the analytic model."""
from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from scaletool.cli.options import deliver, json_option, recipe_argument, set_option
from scaletool.config import load_recipe
from scaletool.fmt import pct, si


@click.command()
@recipe_argument
@set_option
@click.option("--device", default="meta", show_default=True,
              help="Where to build the model: meta allocates no weights (any size), cpu/cuda run real kernels.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences per counted batch.")
@click.option("--no-fvcore", is_flag=True, help="Skip fvcore (FlopCounterMode only).")
@json_option
def count(recipe: str, overrides: tuple[str, ...], device: str, batch: int, no_fvcore: bool, as_json: bool) -> None:
    """Measure parameters and FLOPs of RECIPE's model; print them next to the closed forms.

    Parameters are summed over the built module; FLOPs come from torch's FlopCounterMode (forward
    and forward+backward) and from fvcore (forward). Both count all T² attention scores, so they are
    compared with the analytic 'full' convention; the causal (MFU) convention is shown beside.
    """
    from scaletool.measure.count import count as run_count

    r = load_recipe(recipe, overrides)
    try:
        import torch
        torch.device(device)
    except RuntimeError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    res = run_count(r, device=device, batch=batch, fvcore=not no_fvcore)
    deliver(res, as_json)
    if as_json:
        return res
    con = Console()
    p = res["params"]
    t = Table(title=f"Parameters ({r.model.attention}, built on {device})", title_justify="left")
    for c in ("", "measured", "analytic", "rel. error"):
        t.add_column(c, justify="left" if not c else "right")
    t.add_row("total", f"{p['measured']:,}", f"{p['analytic']:,}", pct(p["rel_error"], 4))
    if p["active"] != p["analytic"]:
        t.add_row("active per token (MoE)", "", f"{p['active']:,}", "")
    t.add_row("12·d²·L vs non-embedding", f"{p['non_embedding']:,}", f"{p['rule_of_thumb_12d2L']:,}",
              pct(p["rule_of_thumb_rel_error"]))
    con.print(t)
    f = res["flops"]
    a = f["analytic"]
    t = Table(title=f"FLOPs for {f['tokens']:,} tokens (batch {res['batch']} × seq_len {res['seq_len']})",
              title_justify="left")
    for c in ("counter", "pass", "measured", "analytic (full)", "rel. error"):
        t.add_column(c, justify="left" if c in ("counter", "pass") else "right")
    fc = f["flop_counter"]
    t.add_row("FlopCounterMode", "forward", si(fc["forward"], "FLOP", 6), si(a["forward_full"], "FLOP", 6),
              pct(fc["forward_rel_error"], 4))
    t.add_row("FlopCounterMode", "forward+backward", si(fc["train"], "FLOP", 6), si(a["train_full"], "FLOP", 6),
              pct(fc["train_rel_error"], 4))
    if "fvcore" in f:
        fv = f["fvcore"]
        t.add_row("fvcore (MACs × 2)", "forward", si(fv["forward"], "FLOP", 6), si(a["forward_full"], "FLOP", 6),
                  pct(fv["forward_rel_error"], 4))
    t.add_row("analytic causal", "forward+backward", "", si(a["train_causal"], "FLOP", 6), "")
    t.add_row("analytic 6·N·T", "forward+backward", "", si(a["train_6N"], "FLOP", 6), "")
    con.print(t)
    for note in f["notes"]:
        con.print(f"• {note}")
