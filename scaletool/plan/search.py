"""The search: every layout family, the micro-batches that fit, predicted and ranked.

Pruning, stated once: memory is monotone in the micro-batch (doubling and bisection find the largest
that fits, :func:`~scaletool.plan.space.largest_fitting`; with a fixed global batch the micro-batch that
needs no accumulation is checked on its own, as it holds fewer gradients), and the step-time model's tokens/s does not
fall as the micro-batch grows at a fixed engine, tensor-parallel degree and checkpointing (compute per
token is constant, communication per token shrinks), so only the :data:`PREDICTED_PER_FAMILY` largest
micro-batches of each family are predicted.
"""
from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from scaletool.analytic.step import fits
from scaletool.config import Recipe, RecipeError
from scaletool.kinds.engines import engine_kind
from scaletool.kinds.float8 import INSTALL_HINT
from scaletool.plan.commands import command_problems, describe
from scaletool.plan.space import (
    CHECKPOINTING,
    MAX_MICRO_BATCH,
    Family,
    Layout,
    MemoryModel,
    engines_for,
    largest_fitting,
    micro_batches,
    planned_weight_cast,
    tensor_parallel_degrees,
    variant,
)

#: micro-batches predicted per family, the largest that fit (see the module docstring)
PREDICTED_PER_FAMILY = 3
ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")
GIB = 2**30


@dataclass(frozen=True)
class Request:
    """What to plan for: the cluster, the card, the batch, and the options that narrow the search."""

    gpus: int
    gpus_per_node: int
    hardware: str
    card_bytes: int
    calibration: object  # scaletool.analytic.step.Calibration
    global_batch_tokens: int | None = None
    price_per_gpu_hour: float | None = None
    attention_variants: bool = False
    top: int = 5
    max_micro_batch: int = MAX_MICRO_BATCH
    labels: tuple[str, ...] | None = None  # engines to consider (None: all)
    compiled: tuple[bool, ...] = (False, True)
    max_tensor_parallel: int | None = None


def variants(recipe: Recipe, wanted: bool) -> tuple[dict[str, Recipe], dict[str, str]]:
    """The recipe, and with ``wanted`` the same model under each other attention kind that validates."""
    out, skipped = {recipe.model.attention: recipe}, {}
    for kind in ATTENTION_KINDS if wanted else ():
        if kind in out:
            continue
        try:
            out[kind] = variant(recipe, {"model.attention": kind})
        except RecipeError as e:
            skipped[kind] = e.problems[0]
    return out, skipped


def families(recipe: Recipe, req: Request, kind: str, notes: list[str]) -> list[Family]:
    """Every engine × tensor-parallel degree × checkpointing × compile combination for one variant."""
    degrees, why = tensor_parallel_degrees(recipe, req.gpus, req.gpus_per_node)
    for tp, line in why.items():
        notes.append(f"{kind}: tensor parallelism {tp} left out: {line}")
    if req.max_tensor_parallel:
        degrees = [d for d in degrees if d <= req.max_tensor_parallel]
    m = recipe.model
    ep = m.ffn == "moe" and m.moe_dispatch == "capacity" and req.gpus > 1 and m.n_routed_experts % req.gpus == 0
    out = []
    for label, engine, stage in engines_for(req.gpus):
        if req.labels is not None and label not in req.labels:
            continue
        for tp in degrees if engine == "fsdp" else [1]:
            for ep_on in (False, True) if engine == "fsdp" and tp == 1 and ep else (False,):
                out += [Family(kind, label, engine, stage, tp, ac, c, ep_on) for ac in CHECKPOINTING for c in req.compiled]
    return out


def family_problems(recipe: Recipe, fam: Family, gpus: int) -> list[str]:
    """Why a family cannot run, as ``scaletool launch`` would refuse its layouts (the recipe rules with the
    layout's keys set, the engine's rules at ``gpus`` ranks) or because the engine's library is not
    installed here; [] when it can. Checked at the recipe's own micro-batch: what depends on the micro-batch (a
    DeepSpeed passthrough that fixes it) is checked on each micro-batch the family offers (:func:`_expand`)."""
    kind = engine_kind(fam.engine)
    if kind.package and importlib.util.find_spec(kind.package) is None:
        return [f"parallel.engine: {fam.engine} needs the {kind.package} package, which is not installed here "
                f"(pip install {kind.package})"]
    if recipe.train.float8 != "none" and importlib.util.find_spec("torchao") is None:
        return [f"train.float8: {recipe.train.float8} needs torchao, which is not installed here ({INSTALL_HINT})"]
    row = {"label": fam.label, "engine": fam.engine, "zero_stage": fam.zero_stage,
           "tensor_parallel": fam.tensor_parallel, "expert_parallel": fam.expert_parallel, "attention": fam.variant,
           "micro_batch_size": recipe.train.micro_batch_size, "grad_accum_steps": recipe.train.grad_accum_steps,
           "activation_checkpointing": fam.activation_checkpointing, "compiled": fam.compiled}
    return command_problems(recipe, row, gpus)


def runnable(recipe: Recipe, fams: list[Family], gpus: int, left_out: list[dict]) -> list[Family]:
    """The families ``launch`` would accept; each other one goes to ``left_out`` with its first reason."""
    out = []
    for fam in fams:
        problems = family_problems(recipe, fam, gpus)
        if problems:
            left_out.append({"layout": describe_family(fam), "label": fam.label, "reason": problems[0]})
        else:
            out.append(fam)
    return out


def describe_family(fam: Family) -> str:
    """``zero3 tp2 full compiled``: a family in a few words (the micro-batch not chosen yet)."""
    return (fam.label + (f" tp{fam.tensor_parallel}" if fam.tensor_parallel > 1 else "")
            + (" ep" if fam.expert_parallel else "") + f" {fam.activation_checkpointing}"
            + (" compiled" if fam.compiled else " eager"))


def left_out_notes(left_out: list[dict]) -> list[str]:
    """One note per reason, naming the engines it keeps out (not one per family)."""
    by_reason: dict[str, list[str]] = {}
    for row in left_out:
        labels = by_reason.setdefault(row["reason"], [])
        if row["label"] not in labels:
            labels.append(row["label"])
    return [f"not offered ({', '.join(labels)}): launch would refuse {'them' if len(labels) > 1 else 'it'}: {reason}"
            for reason, labels in by_reason.items()]


def sequences_per_rank(req: Request, seq_len: int, tp: int) -> int | None:
    """Sequences each data-parallel rank processes per optimizer step to reach the global batch
    (None: no global batch asked; 0: the global batch is not a whole number of them)."""
    if req.global_batch_tokens is None:
        return None
    per = seq_len * (req.gpus // tp)
    return req.global_batch_tokens // per if req.global_batch_tokens % per == 0 else 0


def _expand(recipe: Recipe, fam: Family, largest: int, per_rank: int | None, every: Callable[[int], str | None],
            gpus: int, left_out: list[dict]) -> list[Layout]:
    """The :data:`PREDICTED_PER_FAMILY` largest micro-batches that fit and that launch accepts (largest first
    checked; the first refused one goes to ``left_out`` with its reason)."""
    out, refused = [], None
    fitting = [(m, every(m)) for m in micro_batches(largest, per_rank)]
    for mb, reduce in reversed([(m, e) for m, e in fitting if e is not None]):
        if len(out) == PREDICTED_PER_FAMILY:
            break
        gas = per_rank // mb if per_rank else 1
        lay = Layout(fam.label, fam.engine, fam.zero_stage, fam.tensor_parallel, mb, gas, fam.activation_checkpointing,
                     fam.compiled, fam.variant, fam.expert_parallel, planned_weight_cast(recipe, fam.engine, gas), reduce)
        problems = command_problems(recipe, asdict(lay), gpus)
        if problems:
            if refused is None:
                refused = {"layout": describe(asdict(lay)), "label": fam.label, "reason": problems[0]}
                left_out.append(refused)
            continue
        out.append(lay)
    return out[::-1]


def layout_recipe(recipe: Recipe, lay: Layout, gpus: int) -> Recipe:
    """The recipe a layout runs (copied, not validated again: the families were)."""
    t = recipe.train.model_copy(update={"micro_batch_size": lay.micro_batch_size, "grad_accum_steps": lay.grad_accum_steps,
                                        "activation_checkpointing": lay.activation_checkpointing,
                                        "compile": lay.compiled, "weight_cast": lay.weight_cast})
    p = recipe.parallel.model_copy(update={
        "engine": lay.engine, "tensor_parallel": lay.tensor_parallel, "world_size": gpus,
        "reduce_scatter_every": lay.reduce_scatter_every,
        "expert_parallel": lay.expert_parallel, **({"zero_stage": lay.zero_stage} if lay.engine == "deepspeed" else {})})
    return recipe.model_copy(update={"train": t, "parallel": p})


def search(recipe: Recipe, req: Request, predict: Callable, progress: Callable | None = None) -> dict:
    """Enumerate, fit, predict and rank. ``predict(recipe, layout)`` returns the step model's dict;
    ``progress(done, total)`` is called as families are searched. Raises RecipeError when nothing fits."""
    started = time.perf_counter()
    recipes, skipped = variants(recipe, req.attention_variants)
    notes = [f"attention {k} left out: {line}" for k, line in skipped.items()]
    left_out: list[dict] = []
    fams = [(r, f) for k, r in recipes.items() for f in runnable(r, families(r, req, k, notes), req.gpus, left_out)]
    if not fams:
        raise RecipeError(f"no layout of {req.gpus} GPUs can run: " + "; ".join(sorted({row['reason'] for row in left_out})))
    memory = {k: MemoryModel(r, req.gpus) for k, r in recipes.items()}
    candidates, shortfall, batch_misses = [], None, 0
    for i, (r, fam) in enumerate(fams):
        if progress is not None:
            progress(i, len(fams))
        per_rank = sequences_per_rank(req, r.seq_len, fam.tensor_parallel)
        if per_rank == 0:
            batch_misses += 1
            continue
        mem = memory[fam.variant]

        def every(mb, mem=mem, fam=fam, per_rank=per_rank):
            return mem.reduce_scatter_every(fam, mb, per_rank // mb if per_rank else 1, req.card_bytes)

        def ok(mb, every=every):
            return every(mb) is not None

        largest = largest_fitting(ok, min(per_rank or req.max_micro_batch, req.max_micro_batch))
        # memory grows with the micro-batch except at the one that needs no accumulation, where the engine
        # no longer holds every gradient through the step (single): it may fit past the largest that accumulates
        if per_rank and largest < per_rank <= req.max_micro_batch and ok(per_rank):
            largest = per_rank
        if largest == 0:
            total = mem.total(fam, 1, per_rank or 1)
            over = -fits(total, req.card_bytes)[1]
            if shortfall is None or over < shortfall[0]:
                shortfall = (over, fam, total)
            continue
        candidates += [(r, lay) for lay in _expand(r, fam, largest, per_rank, every, req.gpus, left_out)]
    notes += left_out_notes(left_out)
    if not candidates:
        if left_out and shortfall is None and not batch_misses:
            raise RecipeError("no layout that fits can run: " + "; ".join(sorted({r["reason"] for r in left_out})))
        raise RecipeError(_nothing_fits(recipe, req, shortfall, batch_misses, len(fams)))
    ranked = []
    for r, lay in candidates:
        pred = predict(layout_recipe(r, lay, req.gpus), lay)
        ranked.append((pred["tokens_per_s"], r, lay, pred))
    ranked.sort(key=lambda x: (-x[0], x[2].micro_batch_size))
    rows = [_row(i + 1, r, lay, pred, memory[lay.attention], req) for i, (_, r, lay, pred) in enumerate(ranked)]
    return {"layouts": rows, "considered": {"families": len(fams), "memory_estimates": sum(
        m.estimate.cache_info().currsize for m in memory.values()), "predicted": len(candidates)},
        "notes": notes, "left_out": left_out, "assumptions": list(ranked[0][3].get("assumptions", [])),
        "elapsed_s": time.perf_counter() - started}


def _row(rank: int, r: Recipe, lay: Layout, pred: dict, mem: MemoryModel, req: Request) -> dict:
    fam = Family(lay.attention, lay.label, lay.engine, lay.zero_stage, lay.tensor_parallel,
                 lay.activation_checkpointing, lay.compiled, lay.expert_parallel)
    est = mem.estimate(fam, lay.micro_batch_size, lay.grad_accum_steps, lay.reduce_scatter_every)
    _, margin = fits(est["total_bytes"], req.card_bytes)
    cost = None
    if req.price_per_gpu_hour is not None and pred["tokens_per_s"]:
        cost = req.price_per_gpu_hour * req.gpus / 3600 / pred["tokens_per_s"] * 1e6
    return {"rank": rank, **asdict(lay), "data_parallel": req.gpus // lay.tensor_parallel,
            "global_batch_tokens": lay.micro_batch_size * lay.grad_accum_steps * r.seq_len * (req.gpus // lay.tensor_parallel),
            "memory_bytes": est["total_bytes"], "margin_bytes": int(margin), "memory_phase": est["phase"],
            "prediction": {k: pred.get(k) for k in ("step_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "hfu",
                                                    "bound", "terms", "calibration")},
            "cost_per_million_tokens": cost}


def _nothing_fits(recipe: Recipe, req: Request, shortfall, batch_misses: int, total: int) -> str:
    where = f"{req.gpus} × {req.hardware} ({req.card_bytes / GIB:.1f} GiB each)"
    if shortfall is None:
        T = recipe.seq_len
        return (f"global batch {req.global_batch_tokens:,} tokens: not a whole number of sequences of {T} per "
                f"data-parallel rank for any of the {total} layouts of {req.gpus} GPUs (it must be a multiple of "
                f"{T} × the data-parallel ranks, e.g. {T * req.gpus:,})")
    over, fam, total_bytes = shortfall
    how = f"{fam.label}" + (f", tensor parallel {fam.tensor_parallel}" if fam.tensor_parallel > 1 else "") + \
        (", expert parallel" if fam.expert_parallel else "")
    ckpt = "without checkpointing" if fam.activation_checkpointing == "none" else \
        f"with {fam.activation_checkpointing} checkpointing"
    return (f"no layout fits {where}: the smallest, {how} {ckpt} at micro-batch 1, needs {total_bytes / GIB:.1f} GiB per GPU, "
            f"{over / GIB:.1f} GiB more than fits (more GPUs, a larger card or a shorter --seq-len)")
