"""The layouts a plan considers, and which of them fit the card.

A layout is an engine (single, DDP, FSDP2, ZeRO-1/2/3: scaletool.kinds.engines; across nodes also HSDP: FSDP2
sharding within a node and replicating across nodes), a tensor-parallel degree (the engines that compose with it,
FSDP2; a divisor of the GPUs per node that the heads split over), a micro-batch, the gradient accumulation that
reaches the global batch, activation checkpointing and eager or compiled training; for FSDP2 also pipeline stages
(degree, schedule, virtual stages, pipeline micro-batches) and, for a MoE model, an expert-parallel degree.
Memory grows with the micro-batch, so the largest micro-batch that fits is found by doubling and bisection
(a few estimates per engine instead of one per micro-batch), and every estimate is memoized. A pipeline
layout's memory is its largest stage's (:func:`scaletool.analytic.pipeline.stage_memory`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from scaletool.analytic.float8 import float8_memory
from scaletool.analytic.memory import engine_settings, memory_inputs, tensor_parallel_memory, training_memory
from scaletool.analytic.step import fits
from scaletool.config import Recipe, RecipeError, apply_overrides, recipe_from_dict
from scaletool.kinds.engines import casts_once, engine_kind, tensor_parallel_engine

CHECKPOINTING = ("none", "selective", "full")
#: the largest micro-batch searched when no global batch bounds it
MAX_MICRO_BATCH = 4096


@dataclass(frozen=True)
class Layout:
    """One way to run the recipe on the GPUs: what ``--set`` keys it becomes, nothing predicted yet."""

    label: str  # single, ddp, fsdp, zero1, zero2, zero3
    engine: str
    zero_stage: int
    tensor_parallel: int
    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: str
    compiled: bool
    attention: str
    expert_parallel: bool = False
    weight_cast: str = "micro-batch"  # train.weight_cast (planned_weight_cast)
    reduce_scatter_every: str = "step"  # parallel.reduce_scatter_every (fsdp: micro-batch where step does not fit)
    expert_parallel_degree: int = 0  # parallel.expert_parallel_degree (0: every data-parallel rank)
    pipeline_parallel: int = 1  # parallel.pipeline_* (fsdp only)
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1
    pipeline_microbatches: int = 0  # 0: not a pipeline layout
    data_parallel_replicate: int = 1  # HSDP's replicas (parallel.data_parallel_replicate; label hsdp): one per node


@dataclass(frozen=True)
class Family:
    """Layouts that differ only in micro-batch and accumulation (memory is monotone in the micro-batch)."""

    variant: str  # the attention kind of the recipe variant
    label: str
    engine: str
    zero_stage: int
    tensor_parallel: int
    activation_checkpointing: str
    compiled: bool
    expert_parallel: bool = False
    expert_parallel_degree: int = 0
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1
    pipeline_microbatches: int = 0  # a pipeline family fixes m; its micro-batch is m × sequences per pipeline micro-batch
    data_parallel_replicate: int = 1


def pipeline_recipe(recipe: Recipe, fam: Family, micro_batch: int, grad_accum_steps: int) -> Recipe:
    """The recipe of a pipeline or expert-parallel family at a micro-batch (copied, not validated again: the
    family's settings were validated once, :func:`scaletool.plan.search.families`)."""
    t = recipe.train.model_copy(update={"micro_batch_size": micro_batch, "grad_accum_steps": grad_accum_steps,
                                        "activation_checkpointing": fam.activation_checkpointing,
                                        "compile": fam.compiled})
    p = recipe.parallel.model_copy(update={
        "engine": fam.engine, "expert_parallel": fam.expert_parallel, "expert_parallel_degree": fam.expert_parallel_degree,
        "tensor_parallel": fam.tensor_parallel, "pipeline_parallel": fam.pipeline_parallel,
        "pipeline_schedule": fam.pipeline_schedule,
        "pipeline_virtual_stages": fam.pipeline_virtual_stages, "pipeline_microbatches": fam.pipeline_microbatches or None})
    return recipe.model_copy(update={"train": t, "parallel": p})


def planned_weight_cast(recipe: Recipe, engine: str, grad_accum_steps: int) -> str:
    """``train.weight_cast`` of a layout: ``step`` where the engine takes it, the model computes in 16 bits
    without FP8 and micro-batches accumulate (the same numbers, fewer casts; measured faster), unless the
    recipe states ``micro-batch`` itself; else ``micro-batch``."""
    t = recipe.train
    if "weight_cast" in t.model_fields_set and t.weight_cast == "micro-batch":
        return "micro-batch"
    takes = casts_once(engine, recipe.model.dtype, t.float8)
    return "step" if takes and grad_accum_steps > 1 else "micro-batch"


def stated_reduce_scatter(recipe: Recipe) -> str | None:
    """``parallel.reduce_scatter_every`` where the recipe states it (then every FSDP layout keeps it), else None:
    the plan takes ``step`` where it fits and ``micro-batch`` where only that fits."""
    p = recipe.parallel
    return p.reduce_scatter_every if "reduce_scatter_every" in p.model_fields_set else None


def variant(recipe: Recipe, overrides: dict) -> Recipe:
    """``recipe`` with dotted ``overrides`` applied and validated again (a RecipeError when they conflict)."""
    return recipe_from_dict(apply_overrides(recipe.given(), list(overrides.items())), "recipe")


def tensor_parallel_degrees(recipe: Recipe, gpus: int, gpus_per_node: int) -> tuple[list[int], dict[int, str]]:
    """Tensor-parallel degrees within a node that the recipe allows (heads, K/V heads, FFN width, vocabulary
    and positions split evenly; FSDP2 only), and why each other divisor of the node was left out."""
    ok, why = [], {}
    for tp in (d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and gpus % d == 0):
        if tp == 1:
            ok.append(1)
            continue
        try:
            variant(recipe, {"parallel.engine": tensor_parallel_engine(), "parallel.tensor_parallel": tp})
        except RecipeError as e:
            why[tp] = e.problems[0]
            continue
        ok.append(tp)
    return ok, why


class MemoryModel:
    """Peak bytes per GPU of a layout, memoized: :func:`scaletool.analytic.memory.recipe_memory`'s figure for
    the layout's recipe (compiled as its engine compiles, FP8's components included), so that ``plan`` and
    ``estimate`` give one figure per layout."""

    def __init__(self, recipe: Recipe, gpus: int):
        self.recipe, self.gpus = recipe, gpus
        self.base = engine_settings(recipe)
        self.stage_settings = cache(lambda stage: engine_settings(recipe, stage))
        self.estimate = cache(self._estimate)

    def _estimate(self, fam: Family, micro_batch: int, grad_accum_steps: int = 1, every: str = "step") -> dict:
        r, t = self.recipe, self.recipe.train
        ac = fam.activation_checkpointing
        if fam.pipeline_parallel > 1:  # the largest stage's peak (per-block compile keeps a compiled block's count)
            from scaletool.analytic.pipeline import stage_memory
            stages = stage_memory(pipeline_recipe(r, fam, micro_batch, grad_accum_steps), self.gpus)
            top = max(stages, key=lambda x: x["total_bytes"])
            return {"total_bytes": top["total_bytes"], "phase": f"pipeline stage {top['rank']}", "stages": stages}
        if fam.tensor_parallel > 1:
            tr = t.model_copy(update={"micro_batch_size": micro_batch, "activation_checkpointing": ac,
                                      "grad_accum_steps": grad_accum_steps})
            pr = r.parallel.model_copy(update={"reduce_scatter_every": every,
                                               "data_parallel_replicate": fam.data_parallel_replicate})
            return tensor_parallel_memory(r.model_copy(update={"train": tr, "parallel": pr}), self.gpus,
                                          fam.tensor_parallel)
        cast = planned_weight_cast(r, fam.engine, grad_accum_steps)
        # each ZeRO stage with the settings a recipe at that stage gets (ZeRO-3's own defaults), as estimate does
        base = self.base if not fam.zero_stage else self.stage_settings(fam.zero_stage)
        settings = replace(base, zero_stage=fam.zero_stage or base.zero_stage,
                           expert_parallel=fam.expert_parallel, expert_parallel_degree=fam.expert_parallel_degree,
                           grad_accum_steps=grad_accum_steps,
                           weight_cast_step=cast == "step", reduce_scatter_every_micro_batch=every == "micro-batch")
        # what the engine compiles (the whole model with its loss, or each block): the rule estimate uses
        inputs = memory_inputs(r, fam.engine, micro_batch_size=micro_batch, activation_checkpointing=ac,
                               compiled=fam.compiled, zero_stage=fam.zero_stage)
        # HSDP: FSDP2's states over the shard group (analytic.memory.recipe_memory)
        world = engine_kind(fam.engine).ranks(self.gpus) // fam.data_parallel_replicate
        row = training_memory(r.model, fam.engine, world, inputs, settings)
        if t.float8 == "none":
            return row
        lay = r.model_copy(update={"train": t.model_copy(update={"micro_batch_size": micro_batch}),
                                   "parallel": r.parallel.model_copy(update={"engine": fam.engine})})
        return float8_memory(lay, row)  # its components at the layout's micro-batch and engine

    def total(self, fam: Family, micro_batch: int, grad_accum_steps: int = 1, every: str = "step") -> int:
        return self.estimate(fam, micro_batch, grad_accum_steps, every)["total_bytes"]

    def reduce_scatter_every(self, fam: Family, micro_batch: int, grad_accum_steps: int, card_bytes: int) -> str | None:
        """The ``parallel.reduce_scatter_every`` a layout runs with, None where it fits with neither: the
        recipe's where it states one, else ``step`` where that fits and ``micro-batch`` (an accumulating FSDP
        layout) where only that does."""
        takes_key = "reduce_scatter_every" in engine_kind(fam.engine).keys
        stated = stated_reduce_scatter(self.recipe) if takes_key else None
        if stated:
            options = [stated]
        elif takes_key and grad_accum_steps > 1:
            options = ["step", "micro-batch"]
        else:
            options = ["step"]
        for every in options:
            if fits(self.total(fam, micro_batch, grad_accum_steps, every), card_bytes)[0]:
                return every
        return None


def largest_fitting(fits, upper: int) -> int:
    """The largest micro-batch in 1..upper for which ``fits(m)`` holds, assuming it holds for every
    smaller one (0 when even 1 does not): doubling, then bisection."""
    if upper < 1 or not fits(1):
        return 0
    lo = 1
    while lo * 2 <= upper and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, upper + 1)  # fits(lo), not fits(hi) (or hi past the bound)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def micro_batches(largest: int, sequences_per_rank: int | None) -> list[int]:
    """Micro-batches to consider up to ``largest`` that fits: powers of two and ``largest`` itself; with a
    fixed global batch only those that divide the sequences each data-parallel rank must process per step."""
    if largest < 1:
        return []
    if sequences_per_rank is None:
        out = {1 << k for k in range(largest.bit_length()) if 1 << k <= largest} | {largest}
    else:
        divides = [m for m in range(1, min(largest, sequences_per_rank) + 1) if sequences_per_rank % m == 0]
        out = {m for m in divides if m & (m - 1) == 0} | ({max(divides)} if divides else set())
    return sorted(out)
