"""Each engine's own terms of the step time: how much of its data-parallel communication the compute hides,
the host work it adds, and the device work of its own copies. One form per engine, provided to its kind by
:mod:`scaletool.analytic.engines`; :func:`scaletool.analytic.step.predict_step` adds them to the compute,
memory and tensor-parallel terms every engine shares.

A form is ``form(ctx: StepContext) -> EngineStepTerms``. The overlap fractions and host seconds are the
calibration's ``overheads`` (fitted on the committed runs, docs/prediction.md), read with a default of 0
unless stated here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scaletool.analytic.calibration import Calibration
from scaletool.analytic.params import attention_params, param_counts
from scaletool.analytic.zero3 import leaf_blocks, zero_options
from scaletool.config import ModelConfig, Recipe

#: host seconds of ZeRO-3's work per parameter tensor and micro-batch beyond the one per hooked module that
#: ``zero3_per_module_s`` already counts: in DeepSpeed 0.16-0.18 (deepspeed/runtime/zero/stage3.py,
#: partition_parameters.py) each tensor of a fetched module is re-assembled from the ranks' pieces
#: (``AllGatherCoalescedHandle.wait``: one ``torch.cat`` per tensor) and released, forward and backward; its
#: gradient hook (``reduce_partition_and_remove_grads``) copies the gradient into the IPG bucket, and the
#: bucket's flush splits it per rank (``reduce_scatter_coalesced``) and copies this rank's part into the flat
#: gradient partition (``partition_grads``): about ten Python-issued ops of ~15 µs each. With the block as a
#: leaf module the module hooks run once per block, but these stay per tensor. Checked against the committed
#: 2-GPU runs (benchmarks/results/tp-zero3-2gpu/2xh200-2026-11-26: mla-1b ZeRO-3 leaf blocks 0.260 s a step,
#: FSDP2 0.225 s); a calibration's ``zero3_per_param_s`` replaces it.
ZERO3_PER_PARAM_S = 1.5e-4
#: bytes FSDP2 moves per parameter and micro-batch beyond the weights' 16-bit cast (``CAST_BYTES_PER_PARAM``) and
#: the accumulation every engine is charged, read off its op sequence (torch 2.11, ``_fsdp_collectives.py``) and
#: checked on a profile with no communication (benchmarks/results/pipeline/2xh200-2026-11-29: FSDP2 over one
#: rank, 16 Llama-3-8B blocks, 8 micro-batches: 40 B a parameter and micro-batch of copies and casts measured,
#: 13 charged before): each all-gather's output copied out to the parameters (``split_with_sizes_copy``, a 16-bit
#: read and write), each gradient cast to fp32 into the reduce-scatter's input (``chunk_cat``: 2 B read, 4 written)
#: and the fp32 output added to the shard's gradient (two reads, one write). See :func:`fsdp_copy_bytes`.
FSDP_GATHER_COPY_BYTES, FSDP_GRAD_CAST_BYTES, FSDP_ACCUMULATE_BYTES = 4, 6, 12
#: host seconds per ZeRO-3 optimizer sub-group and step (``_prepare_fp32_grad_for_sub_group``, the
#: optimizer's step, ``_reassign_or_swap_out_partitioned_parameters``: a handful of launches and their
#: Python); a calibration's ``zero3_per_sub_group_s`` replaces it
ZERO3_PER_SUB_GROUP_S = 5e-4


@dataclass(frozen=True)
class StepContext:
    """What an engine's step form reads: the recipe, one rank's model (``local``: the tensor-parallel split
    where there is one), the data-parallel ``ranks``, the accumulated micro-batches ``gas``, the
    data-parallel collectives (``rows``, :func:`scaletool.analytic.comm.communication`'s ``dp`` group) and
    their seconds at the calibrated bus bandwidth (``times``), one micro-batch's forward and backward
    seconds on the rank, and the calibration."""

    recipe: Recipe
    local: ModelConfig
    ranks: int
    gas: int
    rows: list[dict]
    times: list[float]
    forward_s: float
    backward_s: float
    calib: Calibration

    def overhead(self, key: str, default: float = 0.0) -> float:
        return float(self.calib.overheads.get(key, default))

    def seconds(self, op: str) -> tuple[float, int]:
        """Total seconds of the rows of collective ``op`` and how many collectives they are (1 where bucketed)."""
        rows = [(r, t) for r, t in zip(self.rows, self.times) if r["op"] == op]
        return sum(t for _, t in rows), sum((r["count"] or 1) for r, _ in rows)


@dataclass
class EngineStepTerms:
    """An engine's terms per optimizer step: ``exposed_s`` of its data-parallel collectives, ``host_s`` no
    device work hides, ``device_s`` of its own device work (copies the shared terms do not count), and the
    assumptions to print."""

    exposed_s: float = 0.0
    host_s: float = 0.0
    device_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def serial_exposure(ctx: StepContext) -> float:
    """Every collective on the critical path."""
    return sum(ctx.times)


def bucketed_all_reduce_exposure(ctx: StepContext, hide: float) -> float:
    """One bucketed all-reduce overlapping the last micro-batch's backward; ``hide`` of the overlapped part hidden."""
    t = sum(ctx.times)
    return max(0.0, t - hide * ctx.backward_s) + (1 - hide) * min(t, hide * ctx.backward_s)


def prefetched_exposure(ctx: StepContext, hide: float) -> float:
    """Parameter gathers prefetched under the compute (half forward, half backward, with the gradients'
    reduce-scatters in the backward): what exceeds the compute is exposed, so is each micro-batch's first
    gather, and ``1 - hide`` of the rest; all-to-alls on the critical path. HSDP's all-reduce of each gradient
    shard across replicas follows its reduce-scatter in the backward and is counted with it."""
    ag, gathers = ctx.seconds("all_gather")
    rs = ctx.seconds("reduce_scatter")[0] + ctx.seconds("all_reduce")[0]
    a2a, _ = ctx.seconds("all_to_all")
    first = ag / (gathers or 1) * ctx.gas
    over = max(0.0, ag / 2 - ctx.gas * ctx.forward_s) + max(0.0, ag / 2 + rs - ctx.gas * ctx.backward_s)
    hidden = ag + rs - over - first
    return over + first + (1 - hide) * max(0.0, hidden) + a2a


def single_step(ctx: StepContext) -> EngineStepTerms:
    """One process: no collectives, no engine host work."""
    return EngineStepTerms()


def ddp_step(ctx: StepContext) -> EngineStepTerms:
    """DDP: the gradient all-reduce overlaps the last backward (``ddp_overlap``); the reducer's hooks per
    micro-batch (``ddp_micro_batch_s``)."""
    hide = ctx.overhead("ddp_overlap", 1.0)
    return EngineStepTerms(bucketed_all_reduce_exposure(ctx, hide), ctx.gas * ctx.overhead("ddp_micro_batch_s"), 0.0,
                           [f"ddp: gradient all-reduce overlaps the last backward; {hide:.0%} of the overlapped part "
                            "hidden (calibrated)"])


def fsdp_copy_bytes(shards: int, gathers: float) -> float:
    """FSDP2's own copies, bytes per parameter and micro-batch: ``gathers`` all-gathers copied out to the
    parameters, the gradient's fp32 cast into the reduce-scatter and its accumulation on a 1/``shards`` shard
    (the constants above)."""
    return FSDP_GATHER_COPY_BYTES * gathers + FSDP_GRAD_CAST_BYTES + FSDP_ACCUMULATE_BYTES / shards


def fsdp_step(ctx: StepContext) -> EngineStepTerms:
    """FSDP2: gathers prefetched one block ahead (``fsdp_overlap``); its pre-forward and post-backward hooks
    per block and the root, per micro-batch (``fsdp_per_block_s``); its copies (:func:`fsdp_copy_bytes`: two
    gathers a micro-batch under ``reshard_after_forward``, else one) on the rank's parameters at HBM bandwidth."""
    hide = ctx.overhead("fsdp_overlap", 1.0)
    host = ctx.gas * ctx.overhead("fsdp_per_block_s") * (ctx.local.n_layers + 1)
    p = ctx.recipe.parallel
    shards = max(1, ctx.ranks // p.data_parallel_replicate)
    copies = ctx.gas * fsdp_copy_bytes(shards, 2 if p.reshard_after_forward else 1) * param_counts(ctx.local)["total"]
    return EngineStepTerms(prefetched_exposure(ctx, hide), host, copies / (ctx.calib.hbm_gb_s * 1e9),
                           [f"fsdp: parameter gathers prefetched under compute, first gather of each micro-batch "
                            f"exposed; {hide:.0%} of the overlapped part hidden; its gathers' copy-out, gradient casts "
                            "and accumulation at HBM bandwidth"])


def hooked_modules(cfg: ModelConfig, leaf_blocks: bool = False) -> int:
    """Modules whose parameters ZeRO-3 fetches through hooks: per block its projections and norms, or the
    block itself where it is a leaf module (scaletool's default, :mod:`scaletool.analytic.zero3`); plus the
    embedding, final norm and head. Without leaf blocks each holds one parameter tensor (biases aside),
    so this is also the count of parameter tensors."""
    if leaf_blocks:
        return cfg.n_layers + 3
    attn = sum(1 for k, v in attention_params(cfg).items() if v and not k.endswith("bias"))
    ffn = (3 if cfg.ffn in ("swiglu", "moe") else 2) if not cfg.n_moe_layers else 4
    return cfg.n_layers * (attn + ffn + 2) + 3


#: the parameters of the model ``zero12_step_s`` was fitted on (mha-1b, one rank): the term is that many
#: seconds for that many elements, and scales with the rank's partition (elements over ranks)
ZERO12_REFERENCE_PARAMS = 953_223_168


def zero_step(ctx: StepContext) -> EngineStepTerms:
    """DeepSpeed ZeRO at its stage.

    ZeRO-1/2: the gradients' reduce-scatter after the backward and the updated parameters' all-gather after
    the step are on the critical path; its step's work on the rank's partition (``zero12_step_s`` for
    :data:`ZERO12_REFERENCE_PARAMS` elements at one rank, scaled to the partition's elements: stage_1_and_2.py
    flattens the partition's gradients to fp32, walks its tensors for the norm and unscaling, copies the fp32
    partition to the 16-bit one; docs/prediction.md).

    ZeRO-3 (deepspeed/runtime/zero/stage3.py, as scaletool configures it): parameter gathers prefetched up to
    ``stage3_prefetch_bucket_size`` elements ahead (``zero_overlap``, as FSDP2), and the gradients
    reduce-scattered in IPG buckets of ``reduce_bucket_size`` elements on a side stream: the last bucket of
    each micro-batch is flushed when the backward ends, with nothing left to hide it. Device work FSDP2 does
    not do: each gathered tensor re-assembled from the ranks' pieces on the compute stream (a 16-bit read and
    write, forward and backward), and per step the partition's gradients flattened and cast to fp32 and the
    updated fp32 partition copied to the 16-bit one (16 bytes per partitioned element in bf16; AdamW and the
    clipping are the shared optimizer term). The gradients' copies into the bucket and their split per
    rank run on the reduction side stream, under the backward. Host work: per hooked module and micro-batch
    (``zero3_per_module_s``, the coordinator's fetch and release, forward and backward), per further
    parameter tensor (:data:`ZERO3_PER_PARAM_S`) and per optimizer sub-group (:data:`ZERO3_PER_SUB_GROUP_S`).
    """
    p = ctx.recipe.parallel
    if p.zero_stage < 3:
        share = param_counts(ctx.local)["total"] / ZERO12_REFERENCE_PARAMS / max(1, ctx.ranks)
        return EngineStepTerms(serial_exposure(ctx), ctx.overhead("zero12_step_s") * share, 0.0,
                               ["deepspeed ZeRO-1/2: gradient reduce-scatter and parameter all-gather on the critical "
                                "path; its step's work on the partition in proportion to it"])
    cfg, N, gas = ctx.local, ctx.ranks, ctx.gas
    hide = ctx.overhead("zero_overlap", 1.0)
    psi = param_counts(cfg)["total"]
    options = zero_options(ctx.recipe)
    bucket = _elements(options.get("reduce_bucket_size"), psi)
    last = psi - (psi // bucket) * bucket or bucket
    rs, _ = ctx.seconds("reduce_scatter")
    exposed = prefetched_exposure(ctx, hide) + rs * min(1.0, last / psi)
    g16 = cfg.dtype_bytes
    per_micro = 2 * 2 * g16 * psi if N > 1 else 0.0  # re-assembly on the compute stream, forward and backward
    # beyond the shared optimizer term (AdamW and clipping): the flat 16-bit copy and its fp32 cast, and the
    # updated fp32 partition copied to the 16-bit one
    per_step = ((2 * g16 + g16 + 4) + (4 + g16) if cfg.dtype != "fp32" else 8) * psi / N
    device = (gas * per_micro + per_step) / (ctx.calib.hbm_gb_s * 1e9)
    modules = hooked_modules(cfg, leaf_blocks(ctx.recipe))
    tensors = hooked_modules(cfg)
    sub_groups = -(-psi // N // _elements(options.get("sub_group_size"), 10**9))
    host = (gas * ctx.overhead("zero3_per_module_s") * modules
            + gas * ctx.overhead("zero3_per_param_s", ZERO3_PER_PARAM_S) * max(0, tensors - modules)
            + ctx.overhead("zero3_per_sub_group_s", ZERO3_PER_SUB_GROUP_S) * max(1, sub_groups))
    return EngineStepTerms(exposed, host, device, [
        f"deepspeed ZeRO-3: parameter gathers prefetched, first gather of each micro-batch and the last gradient "
        f"bucket ({last / 1e6:,.0f} M elements) exposed; {hide:.0%} of the overlapped part hidden",
        f"deepspeed ZeRO-3: {modules} hooked modules, {tensors} parameter tensors re-assembled and reduced one by "
        f"one on the host; {device * 1e3:.1f} ms of its own copies a step (re-assembly, gradient bucket, fp32 "
        "partition)"])


def _elements(value: object, default: int) -> int:
    """A ZeRO element count as DeepSpeed reads it (the recipe's rules checked it), else ``default``."""
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return default
    return n if n > 0 else default
