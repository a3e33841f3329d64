"""The search: every layout family, the micro-batches that fit, predicted and ranked.

Pruning, stated once: memory is monotone in the micro-batch (doubling and bisection find the largest
that fits, :func:`~scaletool.plan.space.largest_fitting`; with a fixed global batch the micro-batch that
needs no accumulation is checked on its own, as it holds fewer gradients), and the step-time model's tokens/s does not
fall as the micro-batch grows at a fixed engine, tensor-parallel degree and checkpointing (compute per
token is constant, communication per token shrinks), so only the :data:`PREDICTED_PER_FAMILY` largest
micro-batches of each family are predicted.

Pipeline families (FSDP2 only; :func:`pipeline_families`): degrees that are powers of two dividing the GPUs
and at most the layers, each under 1F1B, interleaved 1F1B (2 chunks per rank) and GPipe; the pipeline
micro-batches are fixed per family (:func:`pipeline_microbatch_count`: 4 per stage, or what divides the fixed
global batch) and the searched micro-batch is the sequences per pipeline micro-batch. A MoE model's expert-parallel
degrees are the largest within a node and the largest overall (:func:`expert_degrees`). Compiled and eager
families share one memory estimate (per-block compilation keeps the eager estimate), and only the
:data:`PREDICTED_PER_PIPELINE_FAMILY` largest micro-batches of a pipeline family are predicted.
"""
from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from scaletool.analytic.memory import compile_scope
from scaletool.analytic.step import fits
from scaletool.config import Recipe, RecipeError
from scaletool.kinds.engines import engine_kind, engines_for, engines_with
from scaletool.kinds.float8 import INSTALL_HINT
from scaletool.plan.commands import command_problems, describe
from scaletool.plan.space import (
    CHECKPOINTING,
    MAX_MICRO_BATCH,
    Family,
    Layout,
    MemoryModel,
    largest_fitting,
    micro_batches,
    planned_weight_cast,
    tensor_parallel_degrees,
    variant,
)

#: micro-batches predicted per family, the largest that fit (see the module docstring)
PREDICTED_PER_FAMILY = 3
PREDICTED_PER_PIPELINE_FAMILY = 2
#: (schedule, chunks per rank) a pipeline family takes (the zero-bubble schedules are refused with FSDP2,
#: scaletool.kinds.pipeline)
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1))
#: pipeline micro-batches per stage when the global batch is not fixed: the 1F1B bubble (p - 1)/(m + p - 1) at 20%
MICROBATCHES_PER_STAGE = 4
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
    pipeline: bool = True  # also search pipeline stages (FSDP2)


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


def _modes(engine: str, stage: int, compiled: tuple[bool, ...], notes: list[str]) -> tuple[bool, ...]:
    """The compile modes worth listing for an engine: both, but DeepSpeed ZeRO-3's compiled form where eager is
    searched too (its gathering hooks run eagerly, ``analytic.memory.compile_scope``: the same prediction and
    memory as eager, after a compile)."""
    if compile_scope(engine, True, "auto", stage) == "module" and False in compiled and True in compiled:
        line = "ZeRO-3 compiled not listed apart: its hooks run eagerly, so it is predicted as its eager layout"
        if line not in notes:
            notes.append(line)
        return (False,)
    return compiled


def families(recipe: Recipe, req: Request, kind: str, notes: list[str]) -> list[Family]:
    """Every engine × tensor-parallel degree × checkpointing × compile combination for one variant."""
    degrees, why = tensor_parallel_degrees(recipe, req.gpus, req.gpus_per_node)
    for tp, line in why.items():
        notes.append(f"{kind}: tensor parallelism {tp} left out: {line}")
    if req.max_tensor_parallel:
        degrees = [d for d in degrees if d <= req.max_tensor_parallel]
    m = recipe.model
    # expert parallelism over groups of the data-parallel ranks, for either dispatch (scaletool.engines.expert_parallel)
    eps = expert_degrees(recipe, req.gpus, req.gpus_per_node)
    out = []
    for label, engine, stage in engines_for(req.gpus):
        if req.labels is not None and label not in req.labels:
            continue
        layouts = engine_kind(engine).layouts
        modes = _modes(engine, stage, req.compiled, notes)
        for tp in degrees if "tensor_parallel" in layouts else [1]:
            for deg in [1, *eps] if "expert_parallel" in layouts and tp == 1 else [1]:
                ep_on, ep_deg = deg > 1, (0 if deg == req.gpus else deg)
                out += [Family(kind, label, engine, stage, tp, ac, c, ep_on, ep_deg if ep_on else 0)
                        for ac in CHECKPOINTING for c in modes]
    staged = engines_with("pipeline_parallel")
    if req.pipeline and m.task == "lm" and staged and (req.labels is None or staged[0] in req.labels):
        out += pipeline_families(recipe, req, kind, notes, degrees)
    nodes = req.gpus // req.gpus_per_node
    hsdp = engines_with("data_parallel_replicate")
    if nodes > 1 and hsdp and (req.labels is None or "hsdp" in req.labels):  # shard within a node, replicate across
        # (× tensor parallelism within the node: a (replicate, shard, tp) mesh)
        out += [Family(kind, "hsdp", hsdp[0], 0, tp, ac, c, data_parallel_replicate=nodes)
                for tp in degrees if req.gpus_per_node % tp == 0 for ac in CHECKPOINTING for c in req.compiled]
    return out


def expert_degrees(recipe: Recipe, data_parallel: int, gpus_per_node: int) -> list[int]:
    """Expert-parallel degrees worth planning over ``data_parallel`` ranks: the largest power of two that
    divides both the ranks and the routed experts within a node (the all-to-all over NVLink), and the largest
    overall (fewest experts per rank, the all-to-all across nodes); none for a dense model."""
    m = recipe.model
    if m.ffn != "moe" or data_parallel < 2:
        return []
    common = [d for d in (1 << k for k in range(1, data_parallel.bit_length()))
              if data_parallel % d == 0 and m.n_routed_experts % d == 0]
    if not common:
        return []
    inside = [d for d in common if d <= gpus_per_node]
    return sorted({common[-1], *(inside[-1:])})


def pipeline_families(recipe: Recipe, req: Request, kind: str, notes: list[str],
                      degrees: list[int] | None = None) -> list[Family]:
    """FSDP2 × pipeline stages (× tensor parallelism of the ``degrees`` the recipe allows within a node, or ×
    expert parallelism for a MoE model): degree × schedule × checkpointing × compile, each with its pipeline
    micro-batch count (module docstring)."""
    L, N = recipe.model.n_layers, req.gpus
    engine = engines_with("pipeline_parallel")[0]  # the engine stages compose with (FSDP2)
    out = []
    for P, tp in ((1 << k, t) for k in range(1, N.bit_length()) for t in degrees or [1]):
        if N % (P * tp) or P > L:
            continue
        dp = N // (P * tp)
        eps = expert_degrees(recipe, dp, req.gpus_per_node) if tp == 1 else []
        for sched, v in PIPELINE_SCHEDULES:
            if P * v > L:
                continue
            m = pipeline_microbatch_count(req, recipe.seq_len, P, v, tp)
            if m == 0:
                continue
            for deg in [1, *eps] if len(eps) < 2 else eps:  # a MoE model split over groups: experts off only if no EP
                fam = Family(kind, engine, engine, 0, tp, "none", False, deg > 1, 0 if deg in (1, dp) else deg,
                             P, sched, v, m)
                why = _pipeline_problem(recipe, fam)
                if why:
                    if why not in notes:
                        notes.append(why)
                    continue
                out += [replace(fam, activation_checkpointing=ac, compiled=c) for ac in CHECKPOINTING for c in req.compiled]
    return out


def pipeline_microbatch_count(req: Request, seq_len: int, P: int, v: int, tp: int = 1) -> int:
    """Pipeline micro-batches of a family: :data:`MICROBATCHES_PER_STAGE` × P when the global batch is free;
    with a fixed global batch, the largest of 8P, 4P, 2P, P that divides each data-parallel rank's sequences
    (0: none does, or the rank has fewer sequences than stages)."""
    if req.global_batch_tokens is None:
        return MICROBATCHES_PER_STAGE * P
    per_rank = sequences_per_rank(req, seq_len, tp, P)
    return next((m for m in (8 * P, 4 * P, 2 * P, P) if per_rank and per_rank % m == 0), 0)


def _pipeline_problem(recipe: Recipe, fam: Family) -> str | None:
    """Why the recipe cannot run this pipeline family (the recipe rules of scaletool.kinds.pipeline), or None."""
    try:
        variant(recipe, {"parallel.engine": fam.engine, "parallel.pipeline_parallel": fam.pipeline_parallel,
                         "parallel.pipeline_schedule": fam.pipeline_schedule,
                         "parallel.pipeline_virtual_stages": fam.pipeline_virtual_stages,
                         "parallel.expert_parallel": fam.expert_parallel,
                         "parallel.tensor_parallel": fam.tensor_parallel,
                         "train.micro_batch_size": fam.pipeline_microbatches})
    except RecipeError as e:
        return f"{fam.variant}: pipeline stages left out: {e.problems[0]}"
    return None


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
           "micro_batch_size": fam.pipeline_microbatches or recipe.train.micro_batch_size,
           "grad_accum_steps": recipe.train.grad_accum_steps,
           "activation_checkpointing": fam.activation_checkpointing, "compiled": fam.compiled,
           "expert_parallel_degree": fam.expert_parallel_degree, "pipeline_parallel": fam.pipeline_parallel,
           "pipeline_schedule": fam.pipeline_schedule, "pipeline_virtual_stages": fam.pipeline_virtual_stages,
           "pipeline_microbatches": fam.pipeline_microbatches, "data_parallel_replicate": fam.data_parallel_replicate}
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
            + (f" pp{fam.pipeline_parallel}" if fam.pipeline_parallel > 1 else "")
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


def sequences_per_rank(req: Request, seq_len: int, tp: int, pp: int = 1) -> int | None:
    """Sequences each data-parallel rank processes per optimizer step to reach the global batch
    (None: no global batch asked; 0: the global batch is not a whole number of them)."""
    if req.global_batch_tokens is None:
        return None
    per = seq_len * (req.gpus // (tp * pp))
    return req.global_batch_tokens // per if req.global_batch_tokens % per == 0 else 0


def _expand(recipe: Recipe, fam: Family, largest: int, per_rank: int | None, every: Callable[[int], str | None],
            gpus: int, left_out: list[dict]) -> list[Layout]:
    """The largest micro-batches that fit and that launch accepts, :data:`PREDICTED_PER_FAMILY` of them
    (:data:`PREDICTED_PER_PIPELINE_FAMILY` for a pipeline family, which searches the sequences per pipeline
    micro-batch); largest first checked, the first refused one goes to ``left_out`` with its reason."""
    out, refused = [], None
    m = fam.pipeline_microbatches or 1
    keep = PREDICTED_PER_PIPELINE_FAMILY if fam.pipeline_parallel > 1 else PREDICTED_PER_FAMILY
    fitting = [(b * m, every(b * m)) for b in micro_batches(largest, per_rank // m if per_rank else None)]
    for mb, reduce in reversed([(b, e) for b, e in fitting if e is not None]):
        if len(out) == keep:
            break
        gas = per_rank // mb if per_rank else 1
        lay = Layout(fam.label, fam.engine, fam.zero_stage, fam.tensor_parallel, mb, gas, fam.activation_checkpointing,
                     fam.compiled, fam.variant, fam.expert_parallel, planned_weight_cast(recipe, fam.engine, gas), reduce,
                     fam.expert_parallel_degree, fam.pipeline_parallel, fam.pipeline_schedule, fam.pipeline_virtual_stages,
                     fam.pipeline_microbatches, fam.data_parallel_replicate)
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
        "reduce_scatter_every": lay.reduce_scatter_every, "data_parallel_replicate": lay.data_parallel_replicate,
        "expert_parallel": lay.expert_parallel, "expert_parallel_degree": lay.expert_parallel_degree,
        "pipeline_parallel": lay.pipeline_parallel, "pipeline_schedule": lay.pipeline_schedule,
        "pipeline_virtual_stages": lay.pipeline_virtual_stages, "pipeline_microbatches": lay.pipeline_microbatches or None,
        **({"zero_stage": lay.zero_stage} if engine_kind(lay.engine).zero_stages else {})})
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
        per_rank = sequences_per_rank(req, r.seq_len, fam.tensor_parallel, fam.pipeline_parallel)
        if per_rank == 0:
            batch_misses += 1
            continue
        mem = memory[fam.variant]

        def every(mb, mem=mem, fam=fam, per_rank=per_rank):
            return mem.reduce_scatter_every(fam, mb, per_rank // mb if per_rank else 1, req.card_bytes)

        if fam.pipeline_parallel > 1:  # the searched size: sequences per pipeline micro-batch
            m = fam.pipeline_microbatches

            def ok(b, every=every, m=m):
                return every(b * m) is not None

            largest = largest_fitting(ok, min(per_rank or req.max_micro_batch, req.max_micro_batch) // m)
            if largest == 0:
                continue  # a pipeline that does not fit is not the smallest layout the error names
            candidates += [(r, lay) for lay in _expand(r, fam, largest, per_rank, every, req.gpus, left_out)]
            continue

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
        "pipeline_comparison": pipeline_comparison(rows), "elapsed_s": time.perf_counter() - started}


def pipeline_comparison(rows: list[dict]) -> dict | None:
    """The best layout with pipeline stages and the best without (ranks and tokens/s per GPU), when the
    search predicted both kinds; None otherwise."""
    best = {}
    for row in rows:
        best.setdefault(row["pipeline_parallel"] > 1, row)
    if len(best) < 2:
        return None
    with_pp, without = best[True], best[False]
    keys = ("rank", "label", "pipeline_parallel", "pipeline_schedule", "expert_parallel_degree", "data_parallel")
    return {"with_pipeline": {**{k: with_pp[k] for k in keys},
                              "tokens_per_s_per_gpu": with_pp["prediction"]["tokens_per_s_per_gpu"],
                              "mfu": with_pp["prediction"]["mfu"]},
            "without_pipeline": {**{k: without[k] for k in keys},
                                 "tokens_per_s_per_gpu": without["prediction"]["tokens_per_s_per_gpu"],
                                 "mfu": without["prediction"]["mfu"]},
            "speedup": with_pp["prediction"]["tokens_per_s"] / without["prediction"]["tokens_per_s"]}


def _row(rank: int, r: Recipe, lay: Layout, pred: dict, mem: MemoryModel, req: Request) -> dict:
    from scaletool.predict.claims import outside_layout

    fam = Family(lay.attention, lay.label, lay.engine, lay.zero_stage, lay.tensor_parallel,
                 lay.activation_checkpointing, lay.compiled, lay.expert_parallel, lay.expert_parallel_degree,
                 lay.pipeline_parallel, lay.pipeline_schedule, lay.pipeline_virtual_stages, lay.pipeline_microbatches,
                 lay.data_parallel_replicate)
    est = mem.estimate(fam, lay.micro_batch_size, lay.grad_accum_steps, lay.reduce_scatter_every)
    _, margin = fits(est["total_bytes"], req.card_bytes)
    cost = None
    if req.price_per_gpu_hour is not None and pred["tokens_per_s"]:
        cost = req.price_per_gpu_hour * req.gpus / 3600 / pred["tokens_per_s"] * 1e6
    dp = req.gpus // (lay.tensor_parallel * lay.pipeline_parallel)
    terms = pred.get("terms", {})
    a2a = sum(v for k, v in terms.items() if k in ("comm/ep.all_to_all_s", "comm/dp.all_to_all_total_s"))
    pipeline = None
    if lay.pipeline_parallel > 1:  # what a pipeline layout costs beyond its stages' work
        pipeline = {"bubble_fraction": pred["bubble_fraction"], "bubble_s": terms["pipeline/bubble_s"],
                    "p2p_exposed_s": terms["pipeline/p2p_exposed_s"], "bounding_stage": pred["bounding_rank"],
                    "stage_memory_bytes": [x["total_bytes"] for x in est.get("stages", [])]}
    return {"rank": rank, **asdict(lay), "data_parallel": dp,
            "global_batch_tokens": lay.micro_batch_size * lay.grad_accum_steps * r.seq_len * dp,
            "memory_bytes": est["total_bytes"], "margin_bytes": int(margin), "memory_phase": est["phase"],
            "exposed_all_to_all_s": a2a, "pipeline": pipeline,
            "outside": outside_layout(layout_recipe(r, lay, req.gpus), pred.get("step_s")),
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
