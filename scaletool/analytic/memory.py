"""Training memory per GPU by engine and phase, the engine table, and tensor parallelism's peak."""
from __future__ import annotations

from dataclasses import replace

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.analytic.comm import tensor_parallel_config
from scaletool.analytic.engines import kind_with_forms
from scaletool.analytic.float8 import float8_memory
from scaletool.analytic.params import param_counts
from scaletool.analytic.timeline import (
    COMPONENTS,
    PHASES,
    ZERO3_MAX_REUSE_DISTANCE,
    ZERO3_PREFETCH_BUCKET,
    ZERO3_SUB_GROUP_SIZE,
    ZERO_REDUCE_BUCKET,
    EngineSettings,
    MemoryInputs,
    _timeline,
    _units,
    cast_once_params,
)
from scaletool.analytic.zero3 import PERSISTENCE_FLOOR, zero3_defaults, zero_options
from scaletool.config import ModelConfig, Recipe
from scaletool.errors import RecipeError
from scaletool.kinds.engines import ENGINES, SINGLE, casts_once, engine_kind, table_engines, tensor_parallel_engine


def training_memory(cfg: ModelConfig, engine: str, world_size: int, inputs: MemoryInputs,
                    settings: EngineSettings | None = None, **overrides) -> dict:
    """Peak bytes per GPU of a training step, as the larger of its two phases (see the section comment).

    Model states follow ZeRO (Rajbhandari et al. 2020, §3) as each engine really stores them: torch-native
    engines keep fp32 parameters, gradients and AdamW m, v (16Ψ; FSDP2 shards all of it); DeepSpeed keeps
    16-bit parameters and gradients and an fp32 master with m, v (12Ψ), sharded per ZeRO stage. The
    engine-specific buffers and temporaries are documented, with their DeepSpeed and torch sources, in
    :mod:`scaletool.analytic.engine_memory` (the engine kind's ``memory`` form); activations in :func:`_units` and
    :func:`_activation_bytes_per_token_per_layer` (eager, or compiled as ``inputs.compile_scope`` says).

    MoE: model states count every parameter (all experts are trained). With ``expert_parallel``
    (FSDP2) each rank keeps 1/N of the routed experts itself: states stay Ψ/N per rank, but FSDP's
    per-block all-gather no longer includes the routed experts.

    ``settings`` (or keyword ``overrides`` of its fields) describes the engine's configuration.
    Returns the phases (components per phase), the phase that sets ``total_bytes``, where the backward
    peaks, and the model states and saved activations as single figures.
    """
    s = settings or EngineSettings()
    if overrides:
        s = replace(s, **overrides)
    N = world_size
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}")
    kind = kind_with_forms(engine)
    cast_once = s.weight_cast_step and casts_once(engine, cfg.dtype, "none")  # FP8 is refused with it
    units, loss_temp = _units(cfg, inputs, autocast=kind.autocast, expert_parallel=s.expert_parallel,
                              cast_once=cast_once)
    out = kind.part("memory")(cfg, N, units, loss_temp, s)
    phases = {name: {c: int(out["phases"][name][c]) for c in COMPONENTS} for name in PHASES}
    copies = 2 * cast_once_params(cfg) if cast_once else 0  # train.weight_cast=step: held the whole step
    for name in PHASES:
        phases[name]["weights"] += copies
    ep_saved = _expert_parallel_memory(cfg, N, inputs, units, s, phases) if s.expert_parallel else 0
    totals = {name: sum(comp.values()) for name, comp in phases.items()}
    phase = max(PHASES, key=lambda name: totals[name])
    peak = phases[phase]
    tokens = inputs.micro_batch_size * inputs.seq_len
    blocks = units[1:-1]
    return {
        "engine": engine, "world_size": N, "zero_stage": s.zero_stage if kind.zero_stages else None,
        "weights_bytes": int(out["weights_bytes"]) + copies, "gradients_bytes": int(out["gradients_bytes"]),
        "optimizer_bytes": int(out["optimizer_bytes"]),
        # what autograd keeps at the end of the forward (the loss gradient not included)
        "activations_bytes": int(sum(u.saved for u in units) + ep_saved),
        "activations_per_token_per_layer_bytes": int(sum(u.live for u in blocks) / len(blocks) / tokens) if blocks else 0,
        # the engine's buffers and the temporaries at the peak: what the model states and activations leave out
        "transient_bytes": peak["buffers"] + peak["temporaries"],
        "phases": phases, "phase": phase, "backward_peak_at": out["backward_peak_at"],
        "total_bytes": totals[phase],
    }


def _expert_parallel_memory(cfg: ModelConfig, N: int, inputs: MemoryInputs, units, s: EngineSettings,
                            phases: dict) -> int:
    """Expert parallelism's bytes (:mod:`scaletool.analytic.expert_parallel`) added to ``phases`` in place: the
    busiest rank's extra routed rows saved by every MoE block that keeps its activations (and by the one
    being recomputed), the all-to-all buffers of one layer as backward temporaries, and the routed experts'
    states replicated across groups smaller than the data-parallel ranks. Returns the saved bytes."""
    if not cfg.n_moe_layers:
        return 0
    P = s.expert_parallel_degree or N
    tokens = inputs.micro_batch_size * inputs.seq_len
    moe_units = units[1:1 + cfg.n_moe_layers]  # the backward visits the last (MoE) blocks first
    keeping = sum(1 for u in moe_units if not u.checkpointed) + any(u.checkpointed for u in moe_units)
    saved = int(keeping * ep_analytic.activation_extra_bytes(cfg, tokens, P, inputs.compiled))
    states = ep_analytic.replicated_state_bytes(cfg, N, P)
    phases["backward"]["activations"] += saved
    phases["backward"]["temporaries"] += int(ep_analytic.transient_bytes(cfg, tokens, P))
    for name in PHASES:  # of the 16 B per parameter: fp32 weight 4, gradient 4, AdamW m and v 8
        phases[name]["weights"] += int(states / 4)
        phases[name]["gradients"] += int(states / 4)
        phases[name]["optimizer"] += int(states / 2)
    return saved


def engine_settings(recipe: Recipe, zero_stage: int | None = None) -> EngineSettings:
    """The :class:`EngineSettings` a recipe selects at ``zero_stage`` (default its own): parallel.* and the
    ZeRO options DeepSpeed receives (:func:`scaletool.analytic.zero3.zero_options`: scaletool's ZeRO-3
    defaults under the passthrough; unknown or malformed values fall back to the defaults)."""
    t, p = recipe.train, recipe.parallel
    stage = p.zero_stage if zero_stage is None else zero_stage
    zero = zero_options(recipe, stage)
    ours = zero3_defaults(recipe.model) if stage == 3 else {}

    def number(key: str, default: float) -> float:
        default = ours.get(key, default)
        try:
            return float(zero.get(key, default))
        except (TypeError, ValueError):
            return default

    return EngineSettings(
        zero_stage=stage, reshard_after_forward=p.reshard_after_forward, expert_parallel=p.expert_parallel,
        expert_parallel_degree=p.expert_parallel_degree,
        # the estimate is per GPU, where make_adamw picks the fused AdamW unless told otherwise
        fused_optimizer=t.fused_optimizer is not False, weight_cast_step=t.weight_cast == "step",
        grad_accum_steps=t.grad_accum_steps,
        reduce_scatter_every_micro_batch=p.reduce_scatter_every == "micro-batch",
        reduce_bucket=number("reduce_bucket_size", ZERO_REDUCE_BUCKET),
        overlap_comm=bool(zero.get("overlap_comm", True)),
        max_reuse_distance=number("stage3_max_reuse_distance", ZERO3_MAX_REUSE_DISTANCE),
        prefetch_bucket=number("stage3_prefetch_bucket_size", ZERO3_PREFETCH_BUCKET),
        persistence_threshold=number("stage3_param_persistence_threshold", PERSISTENCE_FLOOR),
        sub_group_size=number("sub_group_size", ZERO3_SUB_GROUP_SIZE))


def table_layouts(recipe: Recipe):
    """The memory table's layouts under the recipe's engine settings: ``(label, engine, kind,
    activation_checkpointing, inputs, settings)`` for every engine row, without and with full checkpointing."""
    for ac in ("none", "full"):
        for label, engine, stage in table_engines():
            kind = engine_kind(engine)
            inp = memory_inputs(recipe, engine, activation_checkpointing=ac, zero_stage=stage)
            base = engine_settings(recipe, stage or None)  # each ZeRO stage with its own defaults
            settings = replace(base, zero_stage=stage or base.zero_stage,
                               expert_parallel=base.expert_parallel and "expert_parallel" in kind.layouts)
            yield label, engine, kind, ac, inp, settings


def memory_table(recipe: Recipe, world_size: int | None = None) -> list[dict]:
    """Training memory for every engine row (:func:`scaletool.kinds.engines.table_engines`: single, DDP, FSDP
    and ZeRO-1/2/3), with and without checkpointing, under the recipe's engine settings (each where it runs:
    single only at world size 1)."""
    N = world_size or recipe.parallel.world_size
    rows = []
    for label, engine, kind, ac, inp, settings in table_layouts(recipe):
        if not kind.runs_on(N):
            continue
        row = training_memory(recipe.model, engine, N, inp, settings)
        rows.append({**row, "activation_checkpointing": ac, "label": label})
    return rows


def compile_scope(engine: str, compile: bool, scope: str = "auto", zero_stage: int = 0) -> str | None:
    """What a layout compiles: None (eager), ``model`` (one graph with the head and the loss: ``single`` under
    ``compile_scope: auto``, any engine under ``model``, and DeepSpeed, whose ``engine.compile`` compiles the
    whole module), ``module`` (DeepSpeed ZeRO-3: the whole module, cut into a graph per module by ZeRO-3's
    gathering hooks, whose own functions exceed dynamo's recompile limit and run eagerly: its activations are
    counted as eager, :func:`memory_inputs`) or ``block`` (each block: DDP and FSDP2 under ``auto``). One rule for
    ``estimate``, ``plan`` and ``train``'s prediction (the engine kind's ``auto_compile_scope`` and
    ``compiles_module``)."""
    if not compile:
        return None
    kind = engine_kind(engine)
    if kind.compiles_module:
        return "module" if zero_stage >= 3 else kind.auto_compile_scope
    return kind.auto_compile_scope if scope == "auto" else scope


def compiled_memory(recipe: Recipe) -> bool:
    """Whether the recipe compiles the whole model in one graph (:func:`compile_scope` ``model``): the head and
    the loss keep the 16-bit logits instead of log_softmax's fp32 output, and their backward no fp32 gradient."""
    t, p = recipe.train, recipe.parallel
    return compile_scope(p.engine, t.compile, t.compile_scope, p.zero_stage) == "model"


def memory_inputs(recipe: Recipe, engine: str | None = None, *, micro_batch_size: int | None = None,
                  activation_checkpointing: str | None = None, compiled: bool | None = None,
                  zero_stage: int | None = None) -> MemoryInputs:
    """The :class:`MemoryInputs` of the recipe (or of ``engine`` and the given fields in its place): its
    micro-batch, sequence length, checkpointing and what ``train.compile`` compiles (:func:`compile_scope`).
    ZeRO-3 compiled (``module``) keeps what eager keeps: its measured peaks on 4 H200s (mla-1b micro-batch 8,
    Qwen2.5-1.5B micro-batch 4 at T=4,096, benchmarks/results/engines-4gpu/) are 1.7% and 1.9% under the eager
    count and 24% and 66% over the compiled one."""
    t = recipe.train
    scope = compile_scope(engine or recipe.parallel.engine, t.compile if compiled is None else compiled,
                          t.compile_scope, recipe.parallel.zero_stage if zero_stage is None else zero_stage)
    return MemoryInputs(t.micro_batch_size if micro_batch_size is None else micro_batch_size, recipe.seq_len,
                        activation_checkpointing or t.activation_checkpointing, t.selective_every,
                        scope not in (None, "module"), scope or "model")


def recipe_memory(recipe: Recipe, world_size: int, *, compiled: bool | None = None) -> dict:
    """Memory estimate for the engine and settings the recipe itself selects, compiled as the recipe's
    ``train.compile`` and the engine's compile scope say (:func:`memory_inputs`): the one figure ``estimate``,
    ``plan`` and ``train``'s prediction give for a layout. ``compiled`` True or False overrides
    ``train.compile`` (True with the engine's scope). ``train.float8`` adds its components
    (:func:`scaletool.analytic.float8.float8_memory`). Tensor parallelism: :func:`tensor_parallel_memory`
    (the eager count; its blocks are compiled after the split, not measured apart)."""
    tp = recipe.parallel.tensor_parallel
    if tp > 1:
        if world_size % tp:
            raise RecipeError(f"parallel.world_size: {world_size} is not a multiple of parallel.tensor_parallel={tp}; "
                              "set the ranks to assume (estimate --world-size)")
        return tensor_parallel_memory(recipe, world_size, tp)
    inp = memory_inputs(recipe, compiled=compiled)
    # HSDP: FSDP2's states and buffers as over the shard group (the replicas' all-reduce runs in place on the shard)
    shard = hsdp_shard(recipe, world_size)
    row = training_memory(recipe.model, recipe.parallel.engine, shard, inp, engine_settings(recipe))
    if shard != world_size:
        row = {**row, "world_size": world_size, "data_parallel_shard": shard}
    return float8_memory(recipe, row)  # train.float8's components (unchanged without it)


def hsdp_shard(recipe: Recipe, world_size: int) -> int:
    """The ranks FSDP2 shards over: ``world_size`` divided by HSDP's replicas (``parallel.data_parallel_replicate``);
    a RecipeError when they do not divide it."""
    R = recipe.parallel.data_parallel_replicate
    if world_size % R:
        raise RecipeError(f"parallel.data_parallel_replicate: {R} replicas do not divide the world size {world_size} "
                          "(set the ranks to assume: estimate --world-size)")
    return world_size // R


def count_memory(cfg: ModelConfig, batch: int, seq_len: int) -> dict:
    """Bytes ``scaletool count`` needs on a real device: the model in fp32, and one forward and backward
    at ``batch`` sequences without autocast (FlopCounterMode runs both), i.e. the backward phase of a
    ``single`` step with no optimizer state and fp32 compute."""
    fp32 = cfg.model_copy(update={"dtype": "fp32"})
    units, loss_temp = _units(fp32, MemoryInputs(batch, seq_len), autocast=False, expert_parallel=False)
    psi = param_counts(cfg)["total"]
    peak, _ = _timeline(units, loss_temp, {"weights": 4 * psi, "optimizer": 0.0},
                        lambda i, done: 4 * done, lambda i: 0.0)
    parts = {k: int(v) for k, v in peak.items() if k != "optimizer"}
    return {**parts, "total_bytes": sum(parts.values())}




def tensor_parallel_memory(recipe: Recipe, world_size: int, tensor_parallel: int) -> dict:
    """Peak bytes per GPU under FSDP2 × tensor parallelism (engines.fsdp with parallel.tensor_parallel).

    Each rank holds :func:`tensor_parallel_config`'s model (sharded weights divided by the group size,
    replicated ones whole) and FSDP2 shards it over ``world_size / tensor_parallel`` data-parallel ranks
    (one data-parallel rank: no FSDP2, the single engine's states and autocast; ``parallel.fsdp_on_one_rank``
    keeps FSDP2 there): :func:`training_memory` of that model gives the states, FSDP2's buffers and the activations of the
    split sub-layers (heads, FFN columns, vocabulary-sharded logits under loss parallelism; MLA's latent
    and the normed inputs the column-parallel projections save are whole on every rank). Sequence
    parallelism (Korthikanti et al. 2022, §4.2.2) then shards what that count keeps whole between the
    sub-layers: each block's two norm inputs (a checkpointed block's one input) and the final norm's
    input, the residual stream, saving ``sequence_parallel_saving_bytes``, subtracted from the
    activations and the peak.
    """
    tp, t, cfg = tensor_parallel, recipe.train, recipe.model
    if world_size % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide world_size={world_size}")
    dp = world_size // tp
    # HSDP × TP: FSDP2 shards over the shard group's data-parallel ranks (the replicas' all-reduce runs in place)
    shard = hsdp_shard(recipe, dp)
    local = tensor_parallel_config(cfg, tp)
    inputs = MemoryInputs(t.micro_batch_size, recipe.seq_len, t.activation_checkpointing, t.selective_every)
    # tensor parallelism is a layout of FSDP2; over every rank (one data-parallel rank) the engine trains the split
    # model without FSDP2, as the single engine does (fp32 parameters under autocast)
    pure = recipe.parallel.pure_tensor_parallel(world_size, tp)
    engine = SINGLE.name if pure else tensor_parallel_engine()
    row = training_memory(local, engine, shard, inputs, reshard_after_forward=recipe.parallel.reshard_after_forward,
                          grad_accum_steps=t.grad_accum_steps,
                          reduce_scatter_every_micro_batch=recipe.parallel.reduce_scatter_every == "micro-batch")
    # the residual stream is 16-bit under FSDP2's mixed precision, fp32 under autocast and in fp32 models
    res = 4 if pure else cfg.dtype_bytes
    ac, every = inputs.activation_checkpointing, inputs.selective_every
    kept = sum(1 if ac == "full" or (ac == "selective" and (i + 1) % every == 0) else 2 for i in range(cfg.n_layers)) + 1
    saving = int(inputs.micro_batch_size * inputs.seq_len * res * cfg.d_model * kept * (1 - 1 / tp))
    # the saved norm inputs are live through the backward and gone by the optimizer step: the saving comes
    # off the backward phase's activations, and the peak phase is chosen again
    phases = {name: dict(comp) for name, comp in row["phases"].items()}
    phases["backward"]["activations"] = max(0, phases["backward"]["activations"] - saving)
    totals = {name: sum(comp.values()) for name, comp in phases.items()}
    phase = max(totals, key=totals.get)
    return {**row, "world_size": world_size, "tensor_parallel": tp, "data_parallel": dp,
            **({"data_parallel_shard": shard} if shard != dp else {}),
            "params_per_rank": param_counts(local)["total"], "sequence_parallel_saving_bytes": saving,
            "activations_bytes": row["activations_bytes"] - saving, "phases": phases, "phase": phase,
            "transient_bytes": phases[phase]["buffers"] + phases[phase]["temporaries"], "total_bytes": totals[phase]}
