"""``scaletool estimate``: the analytic model of a recipe, no model instantiated."""
from __future__ import annotations

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scaletool import api
from scaletool.cli.estimate_summary import UNITS, one_gpu_engine_line, outside_notes, print_summary, single_at_many
from scaletool.cli.options import PositiveFloat, console, deliver, json_option, recipe_argument, set_option
from scaletool.fmt import gib, pct, printable, si
from scaletool.kinds.engines import engine_kind, tensor_parallel_engine
from scaletool.measure.hardware import DEFAULT_HARDWARE

#: the memory table's columns: (heading, component of scaletool.analytic.COMPONENTS)
MEMORY_COLUMNS = [("weights", "weights"), ("grads", "gradients"), ("optim", "optimizer"), ("activ", "activations"),
                  ("buffers", "buffers"), ("temps", "temporaries")]
PHASE_LABELS = {"backward": "bwd", "optimizer_step": "step"}


@click.command()
@recipe_argument
@set_option
@click.option("--tokens", type=click.IntRange(min=1), help="Training tokens for the total-FLOPs line "
              "(default: steps × global batch × seq_len of the recipe).")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sequence (train.seq_len; default the "
              "recipe's, 4096 for a config.json).")
@click.option("--micro-batch", type=click.IntRange(min=1), help="Sequences per GPU and micro-step "
              "(train.micro_batch_size).")
@click.option("--world-size", "--gpus", "world_size", type=click.IntRange(min=1),
              help="GPUs (ranks) for the memory table (default parallel.world_size).")
@click.option("--tensor-parallel", type=click.IntRange(min=1), help="Ranks per tensor-parallel group: the recipe under "
              "FSDP2 × tensor parallelism (engine fsdp), its memory per GPU and communication per step.")
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True, help="Card for the predicted step time per "
              "engine (a profile of `scaletool hardware`).")
@click.option("--gpus-per-node", type=click.IntRange(min=1), help="GPUs per node for the predicted step "
              "[default: 8, or the world size if fewer]; collectives across nodes use --inter-node-gb-s.")
@click.option("--inter-node-gb-s", type=PositiveFloat(), metavar="GB/S", help="Bus bandwidth per GPU across nodes "
              "(what `scaletool calibrate` measures over one rank per node) [default: the calibration's].")
@click.option("--calibration", metavar="NAME|PATH", help="Calibration for the predicted step: a shipped one's name "
              "or a YAML `scaletool calibrate` wrote [default: the --hardware card's].")
@click.option("--detail", is_flag=True, help="The full ledger: parameters by component, FLOPs and KV cache "
              "tables, memory per engine and phase by component, tensor parallelism's collectives.")
@json_option
def estimate(recipe: str, overrides: tuple[str, ...], tokens: int | None, seq_len: int | None,
             micro_batch: int | None, world_size: int | None, tensor_parallel: int | None, hardware: str,
             gpus_per_node: int | None, inter_node_gb_s: float | None, calibration: str | None, detail: bool,
             as_json: bool):
    """Closed-form parameters, FLOPs, KV cache and training memory of RECIPE.

    RECIPE may also be a Hugging Face config.json (or its model folder),
    imported as `scaletool recipe from-hf` does, at 4096 tokens unless
    --seq-len says otherwise. By default a summary: parameters, FLOPs per
    token, KV bytes per token, peak memory and predicted tokens/s per GPU of
    every engine; at one GPU, how many GPUs each engine needs if the model
    does not fit. --detail adds the ledger by component and phase
    (`scaletool docs findings` for its validation).

    \b
    Examples:
      scaletool estimate mla-1b
      scaletool estimate mla-1b --detail
      scaletool estimate Llama-3.1-8B/config.json --seq-len 8192 --gpus 8
      scaletool estimate mha-1b --world-size 8 --set train.micro_batch_size=1
      scaletool estimate recipes/mla-1b.yaml --json | jq .memory.recipe.phases
      scaletool estimate mha-1b --set train.float8=tensorwise   # FP8 GEMMs
      scaletool estimate llama3-8b --gpus 64 --inter-node-gb-s 45
    """
    settings = {} if tensor_parallel is None else {"parallel.engine": tensor_parallel_engine(),
                                                     "parallel.tensor_parallel": tensor_parallel}
    shape = {"train.seq_len": seq_len, "train.micro_batch_size": micro_batch}
    settings.update((k, v) for k, v in shape.items() if v is not None)
    r = api.resolve(recipe, overrides, settings)
    est = api.estimate(r, tokens=tokens, world_size=world_size, hardware=hardware, inter_node_gb_s=inter_node_gb_s,
                       gpus_per_node=gpus_per_node, calibration=calibration)
    deliver(est, as_json)
    if not as_json and not detail:
        print_summary(r, est, console(), own=own_attention(recipe, overrides, r))
    elif not as_json:
        print_estimate(r, est, console())
        if r.parallel.tensor_parallel > 1 and r.parallel.pipeline_parallel == 1:  # stages: per stage, below
            print_tensor_parallel(est, console())
        print_prediction(r, est, console())
    if not as_json and r.parallel.pipeline_parallel > 1:
        print_pipeline(r, world_size or r.parallel.world_size, console())
    if not as_json:
        print_gpus_needed(r, est, hardware, console())
    return est


def print_pipeline(r, world: int, console: Console) -> None:
    """Which blocks each pipeline rank holds (the split analytic.pipeline chooses and train builds), its
    micro-batches in flight and its peak memory, and the schedule's bubble."""
    from scaletool.analytic.pipeline import bubble_fraction, stage_memory, stage_split
    from scaletool.kinds.pipeline import pipeline_microbatches

    p = r.parallel
    if world % p.pipeline_parallel:
        console.print(f"pipeline: {p.pipeline_parallel} stages do not divide world size {world}; set --world-size")
        return
    split = stage_split(r, world)
    m = pipeline_microbatches(r)
    t = Table(title=f"Pipeline: {p.pipeline_parallel} ranks × {p.pipeline_virtual_stages} chunks, {p.pipeline_schedule}, "
              f"{m} micro-batches; FSDP2 over {world // (p.pipeline_parallel * p.tensor_parallel)} per stage"
              + (f" × tensor parallelism over {p.tensor_parallel}" if p.tensor_parallel > 1 else ""), title_justify="left")
    for c in ("rank", "blocks", "holds", "in flight", "memory"):
        t.add_column(c, justify="left" if c in ("blocks", "holds") else "right", no_wrap=c != "blocks")
    for row in stage_memory(r, world, split):
        parts = (["embedding"] if row["first"] else []) + (["norm, output, loss"] if row["last"] else [])
        t.add_row(str(row["rank"]), _ranges(row["layers"]), ", ".join(parts) or "-",
                  f"{row['in_flight_micro_batches']:.3g}", gib(row["total_bytes"]))
    console.print(t)
    console.print(f"bubble {100 * bubble_fraction(p.pipeline_schedule, p.pipeline_parallel, p.pipeline_virtual_stages, m):.1f}% "
                  "of a balanced step; the split balances each chunk's FLOPs, then its memory", highlight=False)


def _ranges(layers: list[int]) -> str:
    """Block indices as runs: 0-7, 16-23."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def own_attention(recipe: str, overrides: tuple[str, ...], r) -> tuple[str, int] | None:
    """(attention, KV bytes per token) of the model as written, where ``--set model.attention=...`` replaced
    its attention; None otherwise, or where the model without that override does not validate."""
    from scaletool.analytic.kv import kv_cache
    from scaletool.errors import RecipeError

    kept = tuple(o for o in overrides if o.partition("=")[0].strip() != "model.attention")
    if len(kept) == len(overrides):
        return None
    try:
        base = api.resolve(recipe, kept)
    except RecipeError:
        return None
    if base.model.attention == r.model.attention:
        return None
    return base.model.attention, kv_cache(base.model)["bytes_per_token"]


def gpus_needed_lines(r, est, hardware: str) -> list[str]:
    """At world size 1, when the recipe's step does not fit one ``hardware`` card: the fewest GPUs each
    engine needs, without and with full checkpointing; [] otherwise."""
    from scaletool.analytic.gpus_needed import MAX_GPUS, gpus_needed
    from scaletool.analytic.step import fits
    from scaletool.measure.hardware import profile_named

    prof = profile_named(hardware)
    if est.memory.world_size != 1 or not prof.memory_bytes or fits(est.memory.recipe.total_bytes, prof.memory_bytes)[0]:
        return []
    lines = [f"Does not fit one {prof.name} ({prof.memory_bytes / 2**30:.0f} GiB, allocator reserve kept)."]
    rows = gpus_needed(r, prof.memory_bytes)
    for ac, title in (("none", "no checkpointing"), ("full", "full checkpointing")):
        some = [x for x in rows if x["activation_checkpointing"] == ac]
        by_count: dict[int, list[str]] = {}
        for x in some:
            if x["gpus"]:
                by_count.setdefault(x["gpus"], []).append(x["label"])
        parts = [f"needs at least {n:,} GPUs under {' / '.join(labels)}" for n, labels in sorted(by_count.items())]
        never = [x["label"] for x in some if not x["gpus"]]
        if never:
            parts.append(f"does not fit {' / '.join(never)} on up to {MAX_GPUS:,} GPUs")
        lines.append(f"{title.capitalize()}: " + "; ".join(parts) + ".")
    return lines


def print_gpus_needed(r, est, hardware: str, console: Console) -> None:
    for line in gpus_needed_lines(r, est, hardware):
        console.print(line, highlight=False)


def print_prediction(r, est, console: Console) -> None:
    """The predicted step per engine, beside the memory table: step time, tokens/s per GPU, MFU, bound."""
    pred = est.prediction
    if pred is None:
        return
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
              title_justify="left", title=f"Predicted step on {pred.hardware} (world size {pred.world_size})")
    for c in ("engine", "ckpt", "step", "tokens/s/GPU", "MFU", "bound"):
        t.add_column(c, justify="left" if c in ("engine", "ckpt", "bound") else "right", no_wrap=True)
    for row in pred.rows:
        if row["step_s"] is None:
            t.add_row(row["label"], "-", "-", "-", "-", row["bound"])
            continue
        t.add_row(row["label"], row["activation_checkpointing"], f"{row['step_s']:.3g} s",
                  f"{row['tokens_per_s_per_gpu']:,.0f}" + ("*" if row.get("outside") else ""),
                  "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%", row["bound"])
    console.print(t)
    for line in outside_notes(pred.rows, console.width):  # as the short view says them
        console.print(line, highlight=False)
    tr = r.train
    console.print(f"micro-batch {tr.micro_batch_size} × accumulation {tr.grad_accum_steps}, "
                  f"{'compiled' if tr.compile else 'eager'}; checkpointing: the recipe's ({tr.activation_checkpointing}) "
                  f"where it fits the card, else the lightest that does; calibration {pred.calibration}"
                  f"{_calibration_file(pred)}. `scaletool plan` searches the layouts.", highlight=False)


def _calibration_file(pred) -> str:
    """Which file the calibration was read from (none for the CPU placeholder or a datasheet default)."""
    path = getattr(pred, "calibration_file", None)
    return f" ({escape(printable(path))})" if path else ""


def print_tensor_parallel(est, console: Console) -> None:
    """The collectives of FSDP2 × tensor parallelism per step and GPU, and the memory per GPU."""
    data = est.model_dump(mode="json")
    c, mem = data["communication"], data["memory"]["recipe"]
    t = Table(title=f"Tensor parallelism: {c['data_parallel']} data-parallel × {c['tensor_parallel']} tensor-parallel "
              "ranks, per GPU and step", title_justify="left")
    t.add_column("group"), t.add_column("collective"), t.add_column("of"), t.add_column("count", justify="right")
    t.add_column("sent", justify="right", no_wrap=True)
    for row in c["collectives"]:
        t.add_row(row["group"], row["op"], row["what"], "-" if row["count"] is None else f"{row['count']:,}",
                  gib(row["wire_bytes"]))
    console.print(t)
    console.print(f"sent per GPU and step: {gib(c['wire_bytes'])} (tensor-parallel {gib(c['tp_wire_bytes'])}, "
                  f"data-parallel {gib(c['dp_wire_bytes'])}); parameters per GPU {mem['params_per_rank']:,} before "
                  f"FSDP2; peak memory per GPU {gib(mem['total_bytes'])} (sequence parallelism saves "
                  f"{gib(mem['sequence_parallel_saving_bytes'])})")


def print_estimate(r, est, console: Console) -> None:
    m, p, f, kv = r.model, est.params, est.flops, est.kv_cache
    ffn = f"{m.ffn}×{m.intermediate_size}"
    if m.ffn == "moe":
        ffn = (f"moe(top-{m.num_experts_per_tok} of {m.n_routed_experts} routed + {m.n_shared_experts} shared, "
               f"×{m.moe_intermediate_size}; {m.first_k_dense_replace} dense ×{m.intermediate_size})")
    console.print(f"[bold]{m.attention.upper()}[/] d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} "
                  f"n_kv_heads={m.n_kv_heads} ffn={ffn} seq_len={est.seq_len} dtype={m.dtype}")
    t = Table(title="Parameters", title_justify="left")
    t.add_column("component"), t.add_column("count", justify="right", no_wrap=True)
    t.add_column("share", justify="right", no_wrap=True)
    for key in ("embedding", "attention", "ffn", "norms", "head"):
        t.add_row(key, f"{getattr(p, key):,}", f"{100 * getattr(p, key) / p.total:.1f}%")
    if p.moe:
        t.add_row("  of which routed experts", f"{p.moe['routed_total']:,}", f"{100 * p.moe['routed_total'] / p.total:.1f}%")
    t.add_row("[bold]total", f"[bold]{p.total:,}", "")
    if p.moe:
        t.add_row("[bold]active per token", f"[bold]{p.active:,}", f"{100 * p.active / p.total:.1f}%")
    t.add_row("non-embedding", f"{p.non_embedding:,}", "")
    t.add_row("12·d²·L", f"{p.rule_of_thumb_12d2L:,}", pct(p.rule_of_thumb_rel_error) + " vs non-emb.")
    console.print(t)

    pt = f.per_token
    t = Table(title=f"FLOPs per token (T={est.seq_len})", title_justify="left")
    t.add_column(""), t.add_column("causal", justify="right", no_wrap=True)
    t.add_column("full T²", justify="right", no_wrap=True)
    t.add_row("training (6N + attention)", si(pt["train_causal"], "FLOP"), si(pt["train_full"], "FLOP"))
    t.add_row("forward (inference)", si(pt["forward_causal"], "FLOP"), si(pt["forward_full"], "FLOP"))
    t.add_row("attention, forward", si(pt["attention_forward_causal"], "FLOP"), si(pt["attention_forward_full"], "FLOP"))
    t.add_row("6·N only", si(pt["dense_6N"], "FLOP"), "")
    if "moe" in pt:
        how = "dropless" if m.moe_dispatch == "dropless" else f"capacity_factor {m.capacity_factor}"
        t.add_row(f"training as computed ({pt['moe']['routed_experts_per_token_computed']:.3g} experts/token, "
                  f"{how})", si(pt["train_causal_computed"], "FLOP"), si(pt["train_full_computed"], "FLOP"))
    console.print(t)
    console.print(f"Training {si(f.train_tokens)} tokens: 6·N·T = {si(f.train_total_6NT, 'FLOP')}, "
                  f"with attention ({pt['convention']}) = {si(f.train_total, 'FLOP')}")

    t = Table(title="KV cache", title_justify="left")
    t.add_column(""), t.add_column("value", justify="right", no_wrap=True)
    t.add_row("elements / token / layer", f"{kv.elements_per_token_per_layer:,}")
    t.add_row(f"bytes / token (all layers, {kv.dtype})", f"{kv.bytes_per_token:,}")
    if kv.naive_bytes_per_token is not None:
        t.add_row("MLA naive (per-head K,V) bytes / token", f"{kv.naive_bytes_per_token:,}")
    t.add_row("MHA-equivalent bytes / token", f"{kv.mha_equivalent_bytes_per_token:,}")
    t.add_row("compression vs MHA", f"{kv.compression_ratio:.2f}×")
    t.add_row(f"per sequence at T={est.seq_len}", gib(kv.bytes_per_sequence_at_seq_len))
    t.add_row("naive score matrix / layer / sequence", gib(est.attention_scores.bytes_per_layer) + " (fused SDPA: 0)")
    console.print(t)
    print_memory(r, est, console)


def memory_unit(rows) -> tuple[str, int]:
    """The largest unit in which every phase total of ``rows`` reads at least 1 (so a small model's rows
    do not all read 0.00 beside DeepSpeed's gigabyte buckets)."""
    low = min(min(p.total for p in (row.phases.backward, row.phases.optimizer_step)) for row in rows)
    return next(((name, size) for name, size in UNITS if low >= size), UNITS[-1])


def memory_table(est, world: int, unit: tuple[str, int]) -> Table:
    """One row per engine, checkpointing and phase: the phase's components and their sum, which is
    the phase's total; ``*`` marks the phase that sets the engine's peak. Fits 80 columns."""
    name, size = unit
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
              title_justify="left", title=f"Training memory per GPU, {name} (world size {world})")
    t.add_column("engine", no_wrap=True), t.add_column("ckpt", no_wrap=True), t.add_column("phase", no_wrap=True)
    for heading, _ in MEMORY_COLUMNS:
        t.add_column(heading, justify="right", no_wrap=True)
    t.add_column("total", justify="right", no_wrap=True)
    for row in est.memory.engines:
        for k, (phase, label) in enumerate(PHASE_LABELS.items()):
            comp = getattr(row.phases, phase)
            peak = phase == row.phase
            t.add_row(row.label if k == 0 else "", row.activation_checkpointing if k == 0 else "",
                      label + ("*" if peak else ""),
                      *(f"{getattr(comp, c) / size:.2f}" for _, c in MEMORY_COLUMNS),
                      f"[bold]{comp.total / size:.2f}" if peak else f"{comp.total / size:.2f}",
                      end_section=k == 1)
    return t


def print_memory(r, est, console: Console) -> None:
    mem, tr = est.memory, r.train
    unit = memory_unit(mem.engines)
    console.print(memory_table(est, mem.world_size, unit))
    rec = mem.recipe
    engine = engine_kind(rec.engine).title(rec.zero_stage)
    at = rec.backward_peak_at or ""
    where = (f" (at {'' if at.startswith('block') else 'the '}{at})" if rec.phase == "backward" and at else "")
    console.print(f"micro-batch {tr.micro_batch_size} × {est.seq_len}, AdamW, {r.model.dtype}. * the phase that sets "
                  "the peak. activ: what autograd keeps; buffers: the engine's; temps: loss gradient, the "
                  "optimizer's gradient copies. --json has every figure in bytes.")
    if single_at_many(est):
        console.print(one_gpu_engine_line(engine, mem.world_size))
    else:
        console.print(f"This recipe ({engine}, {rec.world_size} GPU{'s' if rec.world_size > 1 else ''}, "
                      f"checkpointing {tr.activation_checkpointing}): [bold]{rec.total_bytes / unit[1]:,.2f} {unit[0]}[/] "
                      f"per GPU, set by the {rec.phase.replace('_', ' ')}{where}.")
    if rec.float8:
        f8, (name, size) = rec.float8, unit
        saved = [(f8["autocast_weight_copies_saved_bytes"], "autocast weight copies", "activ"),
                 (f8["fp8_all_gather_saved_bytes"], "FP8 all-gather", "buffers")]
        console.print(f"float8 {tr.float8}: {f8['fp8_params']:,} linear parameters in FP8; FP8 casts "
                      f"+{f8['fp8_cast_temporaries_bytes'] / size:.2f} {name} (temps)"
                      + "".join(f", {label} -{b / size:.2f} {name} ({what})" for b, label, what in saved if b)
                      + "; the engine table is bf16.")
