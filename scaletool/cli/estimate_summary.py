"""The short view of ``scaletool estimate``: the few figures a reader asks first, in about 20 lines at 80
columns (the full ledger is ``--detail``, every figure in bytes is ``--json``).

The per-engine table is assembled from column groups: each is a function ``(recipe, est) -> EngineColumns``
giving its headings and, for every engine label of ``est.memory.engines``, its cells. A new per-engine
figure (a predicted step time, say) is one more function in :data:`ENGINE_GROUPS`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from rich import box
from rich.console import Console
from rich.table import Table

from scaletool.fmt import gib, si
from scaletool.kinds.engines import engine_kind

PHASE_SHORT = {"backward": "bwd", "optimizer_step": "step"}
CKPT_SHORT = {"none": "none", "selective": "sel", "full": "full"}


class EngineColumns(NamedTuple):
    """Headings and, per engine label, one cell per heading (an engine missing from ``cells`` shows '-')."""
    headings: list[str]
    cells: dict[str, list[str]]
    note: str = ""  # one line under the table saying what the columns mean, or ""


#: the float8 savings the summary names where they are not zero (``autocast_*``: single and DDP only;
#: the all-gather: FSDP2 under tensorwise only)
_FP8_SAVINGS = (("autocast_weight_copies_saved_bytes", "autocast weight copies"),
                ("fp8_all_gather_saved_bytes", "FP8 all-gather"))


#: binary units, largest first (the memory table and the summary share them)
UNITS = [("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]


def size(x: float) -> str:
    """Bytes in the largest binary unit that reads at least 1 (TiB included), three significant figures."""
    name, unit = next(((n, u) for n, u in UNITS if abs(x) >= u), UNITS[-1])
    v = x / unit
    return f"{v:.2f} {name}" if v < 10 else f"{v:.1f} {name}" if v < 100 else f"{v:.0f} {name}"


def memory_columns(r, est) -> EngineColumns:
    """Peak memory per GPU without and with full activation checkpointing, and the phase that sets it."""
    cells: dict[str, list[str]] = {}
    for i, ac in enumerate(("none", "full")):  # a layout estimated at one checkpointing (pipeline stages): '-' at the other
        for row in est.memory.engines:
            if row.activation_checkpointing == ac:
                cells.setdefault(row.label, ["-", ""] * 2)[2 * i:2 * i + 2] = [size(row.total_bytes), PHASE_SHORT[row.phase]]
    compiled = ";\ncompiled: single, ZeRO-1/2 whole model; DDP, FSDP2 per block; ZeRO-3 eager" \
        if r.train.compile else ""
    note = (f"Peak memory per GPU at world size {est.memory.world_size}, micro-batch {r.train.micro_batch_size}×"
            f"{est.seq_len}, AdamW{compiled};\nat: the phase that sets it, the backward (bwd) or the optimizer step (step).")
    return EngineColumns(["no ckpt", "at", "full ckpt", "at"], cells, note)


def table_label(label: str, labels: set[str]) -> str:
    """The memory table's label of a prediction row: the same, or without the pipeline schedule the prediction
    names (``fsdp pp4 1f1b`` is the row ``fsdp pp4``)."""
    return label if label in labels or " pp" not in label else label.rsplit(" ", 1)[0]


def prediction_columns(r, est) -> EngineColumns:
    """The step-time model's tokens/s per GPU and MFU of each engine at the recipe's own layout."""
    pred = est.prediction
    if pred is None:
        return EngineColumns([], {})
    tr = r.train
    labels = {row.label for row in est.memory.engines}
    cells = {table_label(row["label"], labels): [
        si(row["tokens_per_s_per_gpu"]) + ("*" if row.get("outside") else "") if row["tokens_per_s_per_gpu"] is not None
        else "-",
        "-" if row["mfu"] is None else f"{100 * row['mfu']:.0f}%", CKPT_SHORT.get(row.get("activation_checkpointing"), "no fit")]
        for row in pred.rows}
    # ckpt: the recipe's checkpointing where it fits the card, else the lightest that does (docs/cli.md)
    where = f"predicted on {pred.hardware}, {'compiled' if tr.compile else 'eager'}, at a ckpt that fits the card"
    # MoE: the dropless dispatch's routing, grouped GEMMs and all-to-alls are terms of the model; the capacity
    # dispatch is not, and its rows are marked outside it (outside_notes)
    note = f"tok/s/GPU, MFU: {where}\n(--detail: the step's terms; `scaletool plan` searches layouts)."
    return EngineColumns(["tok/s/GPU", "MFU", "ckpt"], cells, note)


#: the per-engine column groups of the summary table, left to right
ENGINE_GROUPS: list[Callable[..., EngineColumns]] = [memory_columns, prediction_columns]


def engine_table(r, est, groups: list[Callable[..., EngineColumns]] | None = None) -> tuple[Table, list[str]]:
    """One row per engine of ``est.memory.engines`` (in their order), the groups' columns side by side;
    returns the table and the groups' notes."""
    parts = [g(r, est) for g in (ENGINE_GROUPS if groups is None else groups)]
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    t.add_column("engine", no_wrap=True)
    for part in parts:
        for h in part.headings:
            t.add_column(h, justify="left" if h in ("at", "ckpt") else "right", no_wrap=True)
    labels = list(dict.fromkeys(row.label for row in est.memory.engines))
    for label in labels:
        t.add_row(label, *(c for part in parts for c in part.cells.get(label, ["-"] * len(part.headings))))
    return t, [p.note for p in parts if p.note]


def outside_notes(rows: list[dict], width: int = 80) -> list[str]:
    """A note per reason the step model does not stand behind a predicted layout (its tok/s marked ``*``:
    :func:`scaletool.predict.claims.outside_layout`), naming the layouts, folded at ``width``."""
    import textwrap

    from scaletool.predict.claims import OUTSIDE, by_reason

    return [textwrap.fill(f"note: * {', '.join(labels)}: outside what the model claims ({OUTSIDE[key]})", width,
                          subsequent_indent="  ", break_on_hyphens=False)
            for key, labels in by_reason(rows, lambda row: row["label"]).items()]


def single_at_many(est) -> bool:
    """Whether the table is for several GPUs (``--gpus N``) while the recipe's engine runs one process: its
    one-GPU figure would be a second answer to a question about N GPUs."""
    rec = est.memory.recipe
    return est.memory.world_size > 1 and not engine_kind(rec.engine).distributed


def one_gpu_engine_line(engine: str, world: int) -> str:
    return (f"This recipe's engine ({engine}) runs one process: the rows above are for {world} GPUs\n"
            "(--set parallel.engine=fsdp, say, for its own line).")


def headline_rows(r, est, own: tuple[str, int] | None = None) -> list[tuple[str, str]]:
    """(label, text) lines: parameters, FLOPs per token, KV cache per token, the training run's FLOPs.
    ``own``: (attention, KV bytes per token) of the model's own attention where ``--set model.attention``
    replaced it, so the saving against it is said beside the saving against MHA."""
    m, p, f, kv = r.model, est.params, est.flops, est.kv_cache
    pt = f.per_token
    params = f"{p.total:,} total, {p.non_embedding:,} non-embedding"
    kv_text = f"{kv.bytes_per_token:,} B/token ({kv.dtype}), {kv.compression_ratio:.2f}× less than MHA"
    if own is not None and own[0] != m.attention and own[0] != "mha" and kv.bytes_per_token:
        kv_text += f" and {own[1] / kv.bytes_per_token:.2f}× less than the model's own {own[0].upper()}"
    if m.attention == "mha":
        kv_text = f"{kv.bytes_per_token:,} B/token ({kv.dtype})"
    return [
        ("parameters", params),
        *([("active", f"{p.active:,} parameters per token (top-k routed experts)")] if p.moe else []),
        ("FLOPs/token", f"{si(pt['train_causal'], 'FLOP')} training (causal), "
                        f"{si(pt['forward_causal'], 'FLOP')} forward"),
        ("KV cache", f"{kv_text}; {gib(kv.bytes_per_sequence_at_seq_len)} per sequence"),
        ("training", f"{si(f.train_total, 'FLOP')} for {si(f.train_tokens)} tokens"),
    ]


def print_summary(r, est, con: Console, own: tuple[str, int] | None = None) -> None:
    """The short view: the model in one line, four headline lines, the per-engine table, this recipe's figure
    (``own``: see :func:`headline_rows`)."""
    m = r.model
    ffn = f"{m.ffn}×{m.intermediate_size}"
    if m.ffn == "moe":
        ffn = f"moe top-{m.num_experts_per_tok}/{m.n_routed_experts}+{m.n_shared_experts}"
    con.print(f"[bold]{m.attention.upper()}[/] d_model={m.d_model} layers={m.n_layers} heads={m.n_heads}/"
              f"{m.n_kv_heads} ffn={ffn} seq_len={est.seq_len} {m.dtype}")
    rows = headline_rows(r, est, own)
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        con.print(f"{label:<{width}}  {text}")
    table, notes = engine_table(r, est)
    con.print()
    con.print(table)
    for note in notes:
        con.print(note)
    rec, tr = est.memory.recipe, r.train
    data = est.model_dump(mode="json")
    tp = data["memory"]["recipe"].get("tensor_parallel") or 1
    engine = engine_kind(rec.engine).title(rec.zero_stage)
    at = rec.backward_peak_at or ""
    where = (f" (at {'' if at.startswith('block') else 'the '}{at})" if rec.phase == "backward" and at else "")
    if single_at_many(est):
        con.print(one_gpu_engine_line(engine, est.memory.world_size))
    else:
        con.print(f"This recipe ({engine}, {rec.world_size} GPU{'s' if rec.world_size > 1 else ''}"
                  f"{f', tensor-parallel {tp}' if tp > 1 else ''}, checkpointing {tr.activation_checkpointing}):\n"
                  f"  [bold]{size(rec.total_bytes)}[/] per GPU, peak in the {(rec.phase or 'backward').replace('_', ' ')}"
                  f"{where}.")
    if rec.float8:
        f8 = rec.float8
        con.print(f"float8 {tr.float8}: {f8['fp8_params'] / 1e6:,.0f} M linear parameters in FP8 (in the table: the "
                  "tok/s of single, ddp, fsdp;\n  its memory columns are bf16's);"
                  f" FP8 casts +{size(f8['fp8_cast_temporaries_bytes'])}"
                  + "".join(f", {label} -{size(f8[key])}" for key, label in _FP8_SAVINGS if f8[key]) + ".")
    rows = (data.get("prediction") or {}).get("rows") or []
    hsdp = next((row for row in rows if row["label"].startswith("hsdp")), None)
    if hsdp is not None:  # the recipe's HSDP layout: not a row of the engines' memory table
        c = data["communication"]
        if tp > 1:  # HSDP × TP: one pair of lines for both
            con.print(f"HSDP × TP: {c['data_parallel_replicate']} replicas × {c['data_parallel_shard']}-rank shard groups "
                      f"× {tp} tensor-parallel,\n  {si(hsdp['tokens_per_s_per_gpu'])} tok/s/GPU predicted; "
                      f"{size(c['wire_bytes'])} sent per GPU and step.")
        else:
            con.print(f"HSDP: {c['data_parallel_replicate']} replicas × {c['data_parallel_shard']}-rank shard groups, "
                      f"predicted {si(hsdp['tokens_per_s_per_gpu'])} tok/s per GPU.")
    elif tp > 1 and data.get("communication"):
        c = data["communication"]
        own = next((row for row in rows if row["label"] == f"fsdp tp{tp}"), None)  # not a row of the table above
        speed = "" if own is None else (
            "does not fit the card at any checkpointing; " if own["tokens_per_s_per_gpu"] is None else
            f"predicted {si(own['tokens_per_s_per_gpu'])}{'*' if own.get('outside') else ''} tok/s per GPU "
            f"(ckpt {CKPT_SHORT[own['activation_checkpointing']]}); ")
        con.print(f"Tensor parallelism: {c['data_parallel']} data-parallel × {c['tensor_parallel']} tensor-parallel "
                  f"ranks;\n  {speed}{size(c['wire_bytes'])} sent per GPU and step;\n  sequence parallelism saves "
                  f"{size(data['memory']['recipe']['sequence_parallel_saving_bytes'])}.")
    for line in outside_notes(rows):
        con.print(line, highlight=False)
    con.print("[dim]--detail: the full ledger by component and phase; --json: every figure.[/]")
