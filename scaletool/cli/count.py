"""``scaletool count``: build the model and measure parameters and FLOPs against the analytic model."""
from __future__ import annotations

import click
from rich import box
from rich.console import Console
from rich.table import Table

from scaletool import api
from scaletool.cli.feedback import feedback
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
@click.option("--by", type=click.Choice(["total", "module"]), default="total", show_default=True,
              help="module: parameters and forward FLOPs per module as a tree, measured and closed form.")
@click.option("--depth", type=click.IntRange(min=0), default=2, show_default=True,
              help="With --by module: levels of the tree below the model (0: the model alone).")
@json_option
def count(recipe: str, overrides: tuple[str, ...], device: str, batch: int, no_fvcore: bool, by: str, depth: int,
          as_json: bool):
    """Measure parameters and FLOPs of RECIPE's model; print them next to the closed forms.

    Parameters are summed over the built module; FLOPs come from torch's FlopCounterMode (forward
    and forward+backward) and from fvcore (forward). Both count all T² attention scores, so they are
    compared with the analytic 'full' convention; the causal (MFU) convention is shown beside.
    On cpu or cuda the memory the count needs (fp32 weights, gradients, one batch's activations)
    is estimated first; a count that would not fit is refused with the figures.
    --by module adds a tree of the modules (to --depth levels) with their parameters and
    forward FLOPs, and the closed form beside them where one exists; --json has the tree
    under "modules".

    \b
    Examples:
      scaletool count recipes/mla-1b.yaml
      scaletool count recipes/tiny.yaml --device cpu --batch 4
      scaletool count recipes/deepseek-v3.yaml --no-fvcore --json | jq .params
      scaletool count tiny --by module --depth 3
    """
    r = api.resolve(recipe, overrides)
    with feedback() as progress:
        res = api.count(r, device=device, batch=batch, fvcore=not no_fvcore,
                        module_depth=depth if by == "module" else -1, progress=progress)
    deliver(res, as_json)
    if not as_json:
        print_count(r, res, console())
        if res.modules is not None:
            print_modules(res.modules, console(), lm=r.model.task == "lm")
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


def _signature(node) -> tuple:
    """What makes two sibling modules repeats of each other: type, figures and the same below."""
    a = node.analytic or {}
    return (node.type, node.params, node.forward_flops, a.get("params"), a.get("forward_flops"),
            tuple(_signature(c) for c in node.children))


def _repeats(children) -> list[list]:
    """Consecutive children that repeat each other (a ModuleList's identical blocks), as runs."""
    runs: list[list] = []
    for child in children:
        if runs and _signature(runs[-1][0]) == _signature(child):
            runs[-1].append(child)
        else:
            runs.append([child])
    return runs


def _times(x, k: int):
    return None if x is None else x * k


def module_rows(node, level: int = 0, *, label: str | None = None, k: int = 1):
    """(indented name, params, forward FLOPs, closed forms) for the tree in depth-first order. What a module
    holds or computes outside its children is a row of its own ('(itself)'), so the rows under a module add
    up to it; modules with neither parameters nor FLOPs (rotary tables, identity dropouts) are left out of
    the table (they are in --json). Identical consecutive siblings (``layers.0`` to ``layers.15``) are one
    row, ``0–15 (Block ×16)``, their figures summed, with one block's modules beneath, summed over the k
    blocks too (so the rows still add up)."""
    short = label or (node.type if level == 0 else node.name.rsplit(".", 1)[-1])
    if short.isdigit():
        short = f"{short} ({node.type})"
    a = node.analytic or {}
    yield ("  " * level + short, _times(node.params, k), _times(node.forward_flops, k), _times(a.get("params"), k),
           _times(a.get("forward_flops"), k))
    if node.children and (node.own_params or node.own_flops):
        yield ("  " * (level + 1) + "(itself)", _times(node.own_params, k), _times(node.own_flops, k), None,
               _times(a.get("own_forward_flops"), k))
    for run in _repeats([c for c in node.children if c.params or c.forward_flops]):
        first, last = (c.name.rsplit(".", 1)[-1] for c in (run[0], run[-1]))
        many = f"{first}–{last} ({run[0].type} ×{len(run)})" if len(run) > 1 else None
        yield from module_rows(run[0], level + 1, label=many, k=k * len(run))


def print_modules(tree, con: Console, lm: bool = True) -> None:
    """The module tree: measured parameters and forward FLOPs, the closed form beside them, the share of
    the model's forward FLOPs. Fits 80 columns."""
    t = _table(f"Per module, {tree.tokens:,} tokens: measured and closed form")
    for c in ("module", "params", "closed", "fwd FLOPs", "closed", "share"):
        t.add_column(c, justify="left" if c == "module" else "right", no_wrap=True)
    total = tree.forward_flops or 1

    def num(x):
        return "" if x is None else si(x, "", 4)

    for name, params, flops, a_params, a_flops in module_rows(tree):
        t.add_row(name, num(params), num(a_params), num(flops), num(a_flops), f"{100 * flops / total:.1f}%")
    con.print(t)
    con.print(f"• Forward and backward, all modules: {si(tree.train_flops, 'FLOP', 5)} (FlopCounterMode). Per "
              "module only the forward: torch's module tracker puts some backward operators on a neighbouring "
              "module. (itself): what a module holds or computes outside its children"
              + (" (a tied LM head's matmul runs in the model's own forward)." if lm else "."))
