"""Other projects' published training throughputs, predicted by scaletool's own step-time model.

The table (``profiles/published-runs.tsv``, one row per published measurement, tab-separated, every row with its
``source``) gives each run's model dimensions, sequence length, global and micro batch, GPU count and card,
parallel layout, activation checkpointing, precision, compile and the measured tokens/s per GPU. Each row scaletool
can express becomes a recipe (:func:`express`) predicted with the shipped (or datasheet-default) calibration of
its card at 8 GPUs per node, through the prediction ``estimate`` and ``plan`` use (pipeline layouts by
:mod:`scaletool.analytic.pipeline`, with tensor parallelism inside stages); each row it cannot express is listed
with the reason (DualPipe, context parallelism, FP8 all-gather or another project's FP8 recipe, a micro-batch the
source does not state, a card without a profile). The rows are data to predict: nothing in the model or the
calibrations is fitted to them.

Where a row's notes state the run's peak memory (``mem 82.4 GiB``: torchtitan logs the allocator's peak
*reserved* memory), the estimated peak per GPU (the allocated peak ``estimate`` and ``plan`` give, the largest
stage's under pipeline stages) is set beside it with its relative error and the fit decision on the card: a row
that ran is one the plan must call fitting.
"""
from __future__ import annotations

import csv
import io
import lzma
import os
import re
import stat
import statistics
from pathlib import Path

from scaletool.analytic.calibration import Calibration, calibration_for, default_calibration
from scaletool.analytic.pipeline import peak_bytes
from scaletool.config import Recipe, recipe_from_dict
from scaletool.errors import RecipeError, shorten
from scaletool.fmt import printable
from scaletool.kinds.attention import position_kind
from scaletool.measure.hardware import load_profiles, profile_named
from scaletool.predict.claims import outside_layout
from scaletool.predict.prediction import predict
from scaletool.resources import data_dir

COLUMNS = ("id", "model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "global_batch_seqs",
           "micro_batch", "n_gpus", "gpu", "power_or_hw_note", "layout", "act_ckpt", "precision", "compile",
           "tok_s_per_gpu", "reported_mfu_or_tflops", "pp_row", "notes", "source")
#: the largest table read (the shipped one is a few KB)
MAX_BYTES = 1 << 20
#: GPUs per node of every published run in the table (DGX H100, Grand Teton, Selene, the H200 and H800 clusters)
GPUS_PER_NODE = 8
#: the card column's text -> the hardware profile it ran on, first match wins
CARDS = (("Grand Teton", "H100 96GB"), ("96GB", "H100 96GB"), ("H800", "H800"), ("H200", "H200"),
         ("A100", "A100"), ("H100", "H100 SXM"))


class NotExpressible(Exception):
    """A published row scaletool cannot express as a recipe; the message is the reason."""


def shipped_table() -> Path:
    return data_dir("profiles") / "published-runs.tsv"


def _unpacked(raw: bytes, name: str) -> bytes:
    """An xz-packed table's text, read no further than one byte past :data:`MAX_BYTES`."""
    try:
        return lzma.LZMADecompressor().decompress(raw, max_length=MAX_BYTES + 1)
    except lzma.LZMAError:
        raise RecipeError(f"{name}: not an xz-packed table") from None


def read_table(path: Path) -> list[dict]:
    """The rows of a published-runs table (tab-separated, or that text packed by xz: ``.tsv.xz``); a RecipeError
    (one line) when it cannot be read, is not UTF-8 text, is too large, or lacks a column."""
    name = shorten(str(path))
    try:  # a FIFO or a device would block or never end: opened without blocking, only a regular file is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RecipeError(f"{name}: not a regular file")
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise RecipeError(f"{name}: cannot read: {e.strerror or e}") from None
    if str(path).endswith(".xz"):  # a table kept packed (benchmarks/published/)
        raw = _unpacked(raw, name)
    if len(raw) > MAX_BYTES:
        raise RecipeError(f"{name}: larger than {MAX_BYTES >> 20} MiB; a published-runs table is a few KB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{name}: not UTF-8 text") from None
    reader = csv.DictReader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE)
    try:
        header = reader.fieldnames or []
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise RecipeError(f"{name}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                              f"(a published-runs table has the tab-separated columns {', '.join(COLUMNS)})")
        rows = []
        for i, row in enumerate(reader, start=2):
            if None in row or any(row.get(c) is None for c in COLUMNS):
                raise RecipeError(f"{name}: line {i}: {len(header)} columns expected, got a different number")
            rows.append({c: row[c].strip() for c in COLUMNS})
    except csv.Error:  # a carriage return inside a field, a NUL: the reader stops before counting that line
        raise RecipeError(f"{name}: line {reader.line_num + 1}: not a tab-separated row (a line break or NUL inside a "
                          "field)") from None
    return rows


def _number(text: str) -> float | None:
    m = re.match(r"\s*([0-9][0-9,]*(?:\.[0-9]+)?)", text)
    return float(m.group(1).replace(",", "")) if m else None


def _integer(row: dict, column: str) -> int:
    v = row[column].strip()
    if not v.isascii() or not v.isdigit() or len(v) > 9 or int(v) < 1:
        raise NotExpressible(f"{column} not stated as a positive whole number ({v[:30]!r})")
    return int(v)


def _degree(layout: str, name: str) -> int:
    m = re.search(rf"\b{name}\s*[=:]?\s*(\d{{1,6}})\b", layout)
    if m and int(m.group(1)) < 1:
        raise NotExpressible(f"{name} degree 0 in the layout {layout[:40]!r}")
    return int(m.group(1)) if m else 1


def _card(gpu: str) -> str:
    for key, profile in CARDS:
        if key.lower() in gpu.lower():
            return profile
    raise NotExpressible(f"card {gpu[:40]!r}: no hardware profile")


def _checkpointing(text: str) -> tuple[str, str | None]:
    """(train.activation_checkpointing, a note where it is an approximation) of the act_ckpt column."""
    t = text.lower()
    if t.startswith("none"):
        return "none", None
    if t.startswith(("full", "yes")):
        return "full", None
    if "op" in t or "sac" in t or "selective" in t:
        # torchtitan's op-level SAC keeps every other matmul's output and recomputes the rest of the forward;
        # scaletool checkpoints whole blocks: every second block recomputes about as much
        return "selective", "op-level selective checkpointing as every second block checkpointed"
    raise NotExpressible(f"activation checkpointing {text[:40]!r} not stated")


def _precision(text: str) -> tuple[str, str]:
    """(model.dtype, train.float8) of the precision column."""
    t = text.lower()
    if "all-gather" in t:
        raise NotExpressible("FP8 all-gather (float8 parameters gathered by FSDP2): not modelled")
    fp8 = "float8" in t or "fp8" in t
    if fp8 and ("te" in re.findall(r"[a-z]+", t) or "fp8 mixed" in t):
        raise NotExpressible("Transformer Engine / DeepSeek FP8 recipes: not scaletool's torchao FP8")
    if fp8:
        return "bf16", "tensorwise"  # torchao's default recipe, what torchtitan's float8 runs use
    if "fp16" in t:
        return "fp16", "none"
    if "bf16" in t:
        return "bf16", "none"
    raise NotExpressible(f"precision {text[:40]!r}")


def _search(pattern: str, text: str, what: str) -> int:
    m = re.search(pattern, text, re.IGNORECASE)
    if not m:
        raise NotExpressible(f"{what} not stated ({text[:40]!r})")
    return int(m.group(1))


def _deepseek_v3(row: dict, L: int, d: int, H: int) -> dict:
    """DeepSeek-V3's MLA and DeepSeekMoE from the row's columns (kv_heads: ``MLA (kv_lora R, rope r)``; ffn:
    ``dense F (k layers) / expert f``; model: ``MoE Ee top-k``) and the family's fixed widths and routing, which
    the table does not repeat: q_lora_rank 1536, no-RoPE and value head dims 128, one shared expert, sigmoid
    top-k renormalised and scaled by 2.5, 4 of 8 expert groups (its config.json, as recipes/deepseek-v3.yaml).
    No aux loss and no bias update: the published runs balance the experts' load (a balanced gate)."""
    kv, ffn, name = row["kv_heads"], row["ffn"], row["model"]
    return {"attention": "mla", "kv_lora_rank": _search(r"kv_lora\s*(\d{1,6})\b", kv, "MLA's KV latent width"),
            "qk_rope_head_dim": _search(r"rope\s*(\d{1,6})\b", kv, "MLA's RoPE head dim"),
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_theta": 10000.0, "norm": "rmsnorm",
            "ffn": "moe", "intermediate_size": _search(r"dense\s*(\d{1,7})\b", ffn, "the dense FFN width"),
            "first_k_dense_replace": _search(r"\((\d{1,4})\s*layers?\)", ffn, "the dense layers"),
            "moe_intermediate_size": _search(r"expert\s*(\d{1,7})\b", ffn, "the expert width"),
            "n_routed_experts": _search(r"(\d{1,6})\s*e\b", name, "the routed experts"),
            "num_experts_per_tok": _search(r"top-(\d{1,4})\b", name, "the experts per token"),
            "n_shared_experts": 1, "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "n_group": 8, "topk_group": 4}


#: What an MPT row ran that its recipe does not hold: llm-foundry's kernel (``attn_impl: triton``; ``flash`` for
#: 1B/3B/7B/70B in its large-scale table) and ``no_bias: False``: its NumParams are the recipe's (the learned
#: position table included) + the linear biases, 9·d a block, exactly (tests/predict/test_published.py).
MPT_NOTE = ("attention by llm-foundry's kernel (its benchmarks' attn_impl: triton; flash in part of the large-scale "
            "table) at the calibration's SDPA rate; their linear biases (9·d a block) not modelled")


def _model(row: dict) -> dict:
    name = row["model"]
    L, d, H = _integer(row, "layers"), _integer(row, "hidden"), _integer(row, "heads")
    common = {"d_model": d, "n_layers": L, "n_heads": H, "vocab_size": _integer(row, "vocab"),
              "max_seq_len": _integer(row, "seq_len")}
    if name.lower().startswith("deepseek-v3"):
        return common | _deepseek_v3(row, L, d, H)
    if not (row["kv_heads"].isascii() and row["kv_heads"].isdigit()):
        raise NotExpressible(f"attention {row['kv_heads'][:30]!r} with a MoE FFN: not a dense model of the table's form")
    kv = _integer(row, "kv_heads")
    model = {"d_model": d, "n_layers": L, "n_heads": H, "intermediate_size": _integer(row, "ffn"),
             "vocab_size": _integer(row, "vocab"), "max_seq_len": _integer(row, "seq_len")}
    model |= {"attention": "mha"} if kv == H else {"attention": "gqa", "n_kv_heads": kv}
    if name.lower().startswith("llama"):  # Llama 3: SwiGLU, RoPE, RMSNorm, untied embeddings
        model |= {"ffn": "swiglu", "position_encoding": "rope", "rope_theta": 500000.0, "norm": "rmsnorm"}
    elif name.lower().startswith("mpt"):  # MPT as llm-foundry benchmarked it: GELU MLP, LayerNorm, tied embeddings
        # and learned positions (MPTConfig's defaults; its benchmark yamls set only attn_impl); ALiBi where the row says
        positions = "alibi" if "alibi" in name.lower() else "learned"
        model |= {"ffn": "gelu", "position_encoding": positions, "norm": "layernorm", "tie_embeddings": True}
    elif name.lower().startswith("gpt"):  # GPT-3-style (Megatron): GELU MLP, learned positions, LayerNorm
        model |= {"ffn": "gelu", "position_encoding": "learned", "norm": "layernorm"}
    else:
        raise NotExpressible(f"model family of {name[:40]!r} not known (its FFN, positions and norm)")
    return model


def _replicas(layout: str, gpus: int, tp: int) -> tuple[int, str | None]:
    """HSDP's replicas of the layout column (FSDP2's ``dp_replicate``, Composer's and FSDP1's ``HYBRID_SHARD``):
    ``HSDP RxS`` or ``dp_replicate R`` as stated, else one replica per node of :data:`GPUS_PER_NODE` (sharding
    within a node, as the hybrid strategies do), with a note; 1 (and no note) for a layout without HSDP."""
    low = layout.lower()
    if not ("hsdp" in low or "hybrid" in low or "replicate" in low):
        return 1, None
    m = re.search(r"\bhsdp\s*(\d{1,6})\s*[x×]\s*(\d{1,6})", low) or \
        re.search(r"\b(?:dp[_ -]?)?replicate\s*[=:]?\s*(\d{1,6})", low)
    if m:
        R = int(m.group(1))
        if R < 1 or gpus % (R * tp):
            raise NotExpressible(f"HSDP's {R} replicas × TP{tp} do not divide {gpus} GPUs")
        return R, None
    R = max(1, gpus // GPUS_PER_NODE)
    if gpus % (R * tp):
        raise NotExpressible(f"HSDP with one replica per node: {R} nodes × TP{tp} do not divide {gpus} GPUs")
    return R, f"HSDP with one replica per node ({R}; the layout does not state its replicas)"


def _pipeline(layout: str) -> tuple[int, str, int]:
    """(pipeline ranks, schedule, virtual stages per rank) of the layout column: ``PPn`` alone is 1F1B (torchtitan's
    and Megatron's default), ``PPn`` with ``VPk`` interleaved 1F1B with k model chunks a rank."""
    pp, vp = _degree(layout, "PP"), _degree(layout, "VP")
    if pp == 1:
        return 1, "1f1b", 1
    return (pp, "interleaved-1f1b", vp) if vp > 1 else (pp, "1f1b", 1)


def _layout_problems(row: dict) -> list[str]:
    """What the layout column asks for that scaletool's layouts do not have, one reason each."""
    layout = row["layout"]
    pp, cp = _degree(layout, "PP"), _degree(layout, "CP")
    problems = []
    if "dualpipe" in layout.lower():
        problems.append(f"DualPipe (PP{pp}, DeepSeek's bidirectional schedule): not one of scaletool's pipeline schedules")
    elif row["pp_row"].strip().lower() == "yes" and pp == 1:
        problems.append("pipeline parallelism of a degree the layout does not state")
    if cp > 1:
        problems.append(f"context parallelism (CP{cp})")
    return problems


def express(row: dict) -> dict:
    """The recipe, GPU count, card and approximations of a published row; NotExpressible with the reasons."""
    layout = row["layout"]
    problems = _layout_problems(row)
    try:
        dtype, float8 = _precision(row["precision"])
    except NotExpressible as e:
        problems.append(str(e))
    if problems:
        raise NotExpressible("; ".join(problems))
    if not row["micro_batch"].strip().isdigit():
        raise NotExpressible("micro-batch not stated by the source")
    if "megatron" in layout.lower():
        raise NotExpressible("Megatron-LM's engine (distributed optimizer, fused kernels): not one of scaletool's engines")
    if "fsdp" not in layout.lower() and "hsdp" not in layout.lower():
        raise NotExpressible(f"layout {layout[:40]!r}: not an FSDP layout")
    N, m, gbs = _integer(row, "n_gpus"), _integer(row, "micro_batch"), _integer(row, "global_batch_seqs")
    tp = _degree(layout, "TP")
    pp, schedule, vp = _pipeline(layout)
    ep = _degree(layout, "EP")
    R, hsdp_note = _replicas(layout, N, tp)
    if R > 1 and pp > 1:
        raise NotExpressible("HSDP with pipeline stages: not composed")
    if N % (tp * pp):
        degrees = " × ".join(f"{k}{v}" for k, v in (("TP", tp), ("PP", pp)) if v > 1)
        raise NotExpressible(f"{degrees} does not divide {N} GPUs")
    dp = N // (tp * pp)
    if gbs % (m * dp):
        raise NotExpressible(f"global batch {gbs} is not micro-batch {m} x {dp} data-parallel ranks x an accumulation")
    ac, note = _checkpointing(row["act_ckpt"])
    compiled = row["compile"].strip().lower().startswith("yes")
    model = _model(row) | {"dtype": dtype}
    if pp > 1:  # a pipeline step is the rank's whole batch cut into pipeline micro-batches of m sequences
        train = {"micro_batch_size": gbs // dp, "grad_accum_steps": 1}
    else:
        train = {"micro_batch_size": m, "grad_accum_steps": gbs // (m * dp)}
    train |= {"seq_len": model["max_seq_len"], "activation_checkpointing": ac, "compile": compiled, "float8": float8}
    if ac == "selective":
        train["selective_every"] = 2
    parallel = {"engine": "fsdp", "world_size": N, "tensor_parallel": tp} | ({"data_parallel_replicate": R} if R > 1 else {})
    if re.search(r"shard_grad_op", layout, re.IGNORECASE):  # FSDP's ZeRO-2 form: gathered once, kept to the backward
        parallel["reshard_after_forward"] = False
    if pp > 1:
        parallel |= {"pipeline_parallel": pp, "pipeline_schedule": schedule, "pipeline_virtual_stages": vp,
                     "pipeline_microbatches": gbs // (dp * m)}
    if ep > 1:
        if model.get("ffn") != "moe":
            raise NotExpressible(f"expert parallelism (EP{ep}) of a model without experts")
        parallel |= {"expert_parallel": True, "expert_parallel_degree": ep}
    raw = {"model": model, "train": train, "parallel": parallel}
    try:
        recipe = recipe_from_dict(raw, f"published {row['id']}")
    except RecipeError as e:
        raise NotExpressible(f"scaletool's recipe rules: {e.problems[0] if e.problems else e}") from None
    notes = [n for n in (note, hsdp_note) if n]
    if float8 != "none":
        notes.append("FP8 GEMMs at twice the bf16 curve (no calibration measured an FP8 rate)")
    if position_kind(recipe.model).bias:
        notes.append("ALiBi by their own attention kernel at the causal kernel's rate (scaletool's dense-bias path: "
                     "about 3x its time)")
    if row["model"].lower().startswith("mpt"):
        notes.append(MPT_NOTE)
    if re.search(r"deepep|\bte\b", layout, re.IGNORECASE):
        notes.append("Transformer Engine / DeepEP kernels as scaletool's own (grouped GEMMs, all-to-all)")
    return {"recipe": recipe, "raw": raw, "world_size": N, "card": _card(row["gpu"]), "notes": notes}


def published_row(row_id: str, path: Path | None = None) -> dict:
    """The row ``row_id`` of a published-runs table (the shipped one by default); a RecipeError naming the
    table's ids when there is none."""
    table = path or shipped_table()
    rows = read_table(table)
    for row in rows:
        if row["id"] == row_id:
            return row
    ids = ", ".join(printable(r["id"]) for r in rows[:40]) + (", ..." if len(rows) > 40 else "")
    raise RecipeError(f"published row {shorten(row_id, 40)!r}: not in {shorten(str(table))} (its rows: {ids})")


_MEMORY = re.compile(r"\bmem(?:ory)?\s+(\d{1,4}(?:\.\d{1,3})?)\s*GiB\b", re.IGNORECASE)


def published_memory_gib(row: dict) -> float | None:
    """The peak memory per GPU a row's notes state (``mem 82.4 GiB``, the first such figure), or None."""
    m = _MEMORY.search(row.get("notes") or "")
    value = float(m.group(1)) if m else 0.0
    return value if value > 0 else None


def _memory_fields(x: dict, row: dict, profile) -> dict:
    """The row's published and estimated peak memory per GPU, the relative error and the fit decision; {} when the
    row states none."""
    from scaletool.analytic.step import fits

    published = published_memory_gib(row)
    if published is None:
        return {}
    est = peak_bytes(x["recipe"], x["world_size"])
    return {"published_memory_gib": published, "estimated_memory_gib": est / 2**30,
            "memory_rel_error": est / 2**30 / published - 1,
            "memory_fits": bool(fits(est, profile.memory_bytes)[0]) if profile.memory_bytes else None}


def _calibration(card: str, profiles, cache: dict) -> Calibration:
    if card not in cache:
        prof = profile_named(card, profiles)
        cache[card] = calibration_for(prof.name) or default_calibration(prof)
    return cache[card]


def _stats(rows: list[dict]) -> dict:
    errs = [abs(r["rel_error"]) for r in rows]
    return {"n": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
            "worst_abs_error": max(errs) if errs else None}


def _own_kernels(recipe: Recipe) -> Recipe:
    """The recipe as the step model should time another project's run: ALiBi through their own attention kernel
    (the bias computed in it, the masked half skipped) at the causal kernel's rate, not scaletool's dense-bias path."""
    if not position_kind(recipe.model).bias:
        return recipe
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"position_encoding": "none"})})


def validate_published(paths: list[Path] | None = None) -> dict:
    """Every expressible row's predicted and published tokens/s per GPU and the relative error; the rows not
    expressible with their reasons; the error distribution overall, on one node and across nodes."""
    profiles, cache, rows, skipped = load_profiles(), {}, [], []
    for path in paths or [shipped_table()]:
        for row in read_table(Path(path)):
            measured = _number(row["tok_s_per_gpu"])
            try:
                if not measured or measured <= 0:
                    raise NotExpressible(f"tokens/s per GPU {row['tok_s_per_gpu'][:30]!r} is not a positive number")
                x = express(row)
                cal = _calibration(x["card"], profiles, cache)
            except (NotExpressible, RecipeError) as e:
                skipped.append({"id": row["id"], "model": row["model"], "reason": str(e), "source": row["source"]})
                continue
            pred = predict(_own_kernels(x["recipe"]), cal, world_size=x["world_size"], gpus_per_node=GPUS_PER_NODE,
                           designed_bubble=True)  # their implementation runs the schedule as designed
            N = x["world_size"]
            rows.append({"id": row["id"], "model": row["model"], "card": x["card"], "calibration": cal.name,
                         "gpus": N, "nodes": max(1, N // GPUS_PER_NODE), "layout": row["layout"],
                         "activation_checkpointing": x["recipe"].train.activation_checkpointing,
                         "compiled": x["recipe"].train.compile, "float8": x["recipe"].train.float8,
                         "measured_tokens_per_s_per_gpu": measured,
                         "predicted_tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"],
                         "rel_error": pred["tokens_per_s_per_gpu"] / measured - 1, "bound": pred["bound"],
                         "outside": outside_layout(x["recipe"], pred["step_s"]),  # said, still counted
                         "notes": x["notes"], "source": row["source"]}
                        | _memory_fields(x, row, profile_named(x["card"], profiles)))
    one = [r for r in rows if r["nodes"] == 1]
    many = [r for r in rows if r["nodes"] > 1]
    mem = [r for r in rows if "memory_rel_error" in r]
    memory = {"n": len(mem), "convention": "estimated allocated peak against the published (reserved) peak",
              "median_abs_error": statistics.median(abs(r["memory_rel_error"]) for r in mem) if mem else None,
              "worst_abs_error": max((abs(r["memory_rel_error"]) for r in mem), default=None),
              "called_not_fitting": [r["id"] for r in mem if r["memory_fits"] is False]}
    return {"rows": rows, "not_expressible": skipped,
            "summary": {"all": _stats(rows), "one_node": _stats(one), "multi_node": _stats(many), "memory": memory}}
