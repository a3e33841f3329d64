"""Pipeline stages' step time: every rank's terms, the bubble, the sends, and the rank that bounds the step.

Torch-free and IO-free, like the rest of :mod:`scaletool.analytic`; the split and the memory per stage are
:mod:`scaletool.analytic.pipeline`'s. :func:`pipeline_step`: each rank's compute at the calibrated rates (the
output layer on the last rank only), the bubble (the other ranks' micro-batch device times over ``v``, ``(p - 1)/v``
slots where stages are equal, times the schedule's idle share of a slot), the fill's and drain's point-to-point
sends, FSDP2 per stage, optimizer and host; a micro-batch at least its eager blocks' issue time (:mod:`.host`), the
bubble not (a host-bound rank issues on through it); the rank with the most work bounds the step and is named.
"""
from __future__ import annotations

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.analytic.calibration import Calibration
from scaletool.analytic.comm import tensor_parallel_config
from scaletool.analytic.engine_step import fsdp_copy_bytes
from scaletool.analytic.host import eager_dispatch_s
from scaletool.analytic.params import moe_params
from scaletool.analytic.pipeline import (
    OPTIMIZER_BYTES_PER_PARAM,
    _is_moe,
    _stage_cfg,
    bubble_fraction,
    expert_degree,
    rank_layers,
    routed_params,
    stage_memory,
    stage_split,
)
from scaletool.analytic.timeline import MemoryInputs
from scaletool.config import ModelConfig, Recipe
from scaletool.kinds.engines import engine_kind
from scaletool.kinds.pipeline import chunk_ranks, pipeline_microbatches, schedule_kind


def _head_seconds(cfg: ModelConfig, tokens: int, calib: Calibration, casts_weights: bool) -> float:
    """One micro-batch's output layer on the last rank: its GEMM forward and backward (3 × forward), the
    logits' element-wise traffic and its weight's 16-bit cast, as :func:`scaletool.analytic.step._compute` counts
    them: the logits at the eager factor compiled or not (a stage compiles each block alone; the head and the
    loss run eager)."""
    from scaletool.analytic.step import CAST_BYTES_PER_PARAM

    V, d = cfg.vocab_size, cfg.d_model
    gemm = 3 * 2 * tokens * V * d / calib.gemm_rate(tokens, V, d)
    traffic = calib.elementwise["eager_bytes_factor"] * tokens * 4 * V
    return gemm + (traffic + (CAST_BYTES_PER_PARAM * V * d if casts_weights else 0)) / (calib.hbm_gb_s * 1e9)


def _expert_terms(recipe: Recipe, layers: list[int], tokens: int, micro_batches: int, ep: int, dp: int, G: int,
                  frac: float, calib: Calibration) -> dict:
    """Seconds per optimizer step one pipeline rank spends on expert parallelism for its MoE blocks, all on
    the critical path (as :func:`scaletool.analytic.step.predict_step` counts them): the all-to-alls of
    :func:`~scaletool.analytic.expert_parallel.all_to_all_rows` (the group is ``ep`` consecutive ranks of the
    stage, across nodes when it is larger than a node), the busiest rank's extra GEMMs and the split sizes'
    host reads (:func:`~scaletool.analytic.expert_parallel.step_terms`), and with groups smaller than the
    stage's data-parallel ranks the all-reduce of the expert gradients over their dp/ep replicas."""
    cfg = recipe.model
    moe = [i for i in layers if _is_moe(cfg, i)]
    zero = {"comm/ep.all_to_all_s": 0.0, "ep/imbalance_s": 0.0, "ep/host_sync_s": 0.0, "ep/expert_gemm_shape_s": 0.0,
            "comm/ep.replica_all_reduce_s": 0.0}
    if ep == 1 or not moe:
        return zero
    local = _stage_cfg(cfg, moe)
    local = local.model_copy(update={"first_k_dense_replace": 0})  # the rank's MoE blocks only
    recomputed = round(frac * len(moe))
    rows = ep_analytic.all_to_all_rows(local, tokens, micro_batches, ep, recomputed)
    a2a = sum(r["wire_bytes"] for r in rows) / calib.bus_bandwidth("all_to_all", ep, ep > G)
    terms = ep_analytic.step_terms(local, tokens, micro_batches, ep, frac, calib.gemm_rate)
    terms["ep/expert_gemm_shape_s"] = ep_analytic.expert_gemm_shape_s(local, tokens, micro_batches, ep, frac,
                                                                      calib.gemm_rate)
    replicas = dp // ep
    sync = 0.0
    if replicas > 1:  # fp32 gradients of the local experts, summed over the replicas (ranks ep apart)
        grads = 4 * len(moe) * moe_params(cfg)["routed"] / ep
        sync = 2 * grads * (replicas - 1) / replicas / calib.bus_bandwidth("all_reduce", replicas, dp > G)
    return {**zero, "comm/ep.all_to_all_s": a2a, **terms, "comm/ep.replica_all_reduce_s": sync}


def _tp_seconds(recipe: Recipe, local: ModelConfig, first: bool, last: bool, G: int,
                calib: Calibration) -> tuple[float, float]:
    """Tensor parallelism's collectives on one pipeline rank (``local``: its blocks as one rank of the group holds
    them), as :func:`scaletool.analytic.comm.tensor_parallel_communication` counts them for a stage: (seconds per
    pipeline micro-batch, every row but the replicated weights' gradients; seconds per step, those). The group is
    ``tp`` consecutive ranks."""
    from scaletool.analytic.comm import tensor_parallel_communication
    from scaletool.analytic.network import group_seconds

    p, t = recipe.parallel, recipe.train
    if p.tensor_parallel == 1:
        return 0.0, 0.0
    gas = t.grad_accum_steps
    inputs = MemoryInputs(t.micro_batch_size // pipeline_microbatches(recipe), recipe.seq_len,
                          t.activation_checkpointing, t.selective_every)
    mb = step = 0.0
    for r in tensor_parallel_communication(local, p.tensor_parallel, inputs, gas, first=first, last=last):
        secs = group_seconds(calib, r["op"], r["message_bytes"], p.tensor_parallel, min(p.tensor_parallel, G),
                             r["count"])["seconds"]
        if r["what"].startswith("replicated weights"):  # once a step
            step += secs
        else:  # the rows count every micro-batch of the accumulation
            mb += secs / gas
    return mb, step


def _rank_terms(recipe: Recipe, r: int, layers: list[int], stage: dict, N: int, G: int, compiled: bool,
                calib: Calibration) -> dict:
    """One pipeline rank's seconds per optimizer step (:func:`pipeline_step`): its micro-batches' compute and
    expert-parallel terms, optimizer, exposed FSDP2 within the stage, host, and their sum ``busy_s``."""
    from scaletool.analytic.step import _compute, _tp_dispatch, tp_microbatch_dispatch

    t, p = recipe.train, recipe.parallel
    P, m, T, gas = p.pipeline_parallel, pipeline_microbatches(recipe), recipe.seq_len, t.grad_accum_steps
    tp = p.tensor_parallel
    cfg = tensor_parallel_config(recipe.model, tp)  # one rank of the stage's tensor-parallel group
    dp, ep = N // (P * tp), expert_degree(recipe, N)
    tokens = t.micro_batch_size // m * T
    owners = chunk_ranks(p.pipeline_schedule, P, p.pipeline_virtual_stages)
    hbm, ov = calib.hbm_gb_s * 1e9, calib.overheads
    local = _stage_cfg(cfg, layers)
    c = _compute(local, recipe.model, engine_kind(p.engine), tokens, T, t.activation_checkpointing,
                 t.selective_every, compiled, calib, head_eager=compiled)  # stages compile each block alone
    per_mb = c["gemm_forward"] + c["gemm_backward"] + c["attention"] + c["elementwise"] + c["recompute"]
    if owners[-1] != r:
        per_mb -= _head_seconds(cfg, tokens, calib, engine_kind(p.engine).casts_weights)
    tp_mb, tp_step = _tp_seconds(recipe, local, owners[0] == r, owners[-1] == r, G, calib)
    per_mb += tp_mb  # tensor parallelism's collectives: on the critical path (analytic.step: no overlap)
    ep_terms = _expert_terms(recipe, layers, tokens, gas * m, ep, dp, G, c["recompute_fraction"], calib)
    # expert parallelism's work waits inside each micro-batch: the slot of this rank grows by its share
    compute = gas * m * per_mb
    per_mb += (sum(ep_terms.values()) - ep_terms["comm/ep.replica_all_reduce_s"]) / (gas * m)
    # an eager stage's blocks are issued from Python: a micro-batch's slot is at least the host's issue time
    # (analytic.host), the device waiting where its work is shorter (FSDP2's hooks are in ``host`` below)
    # TP: the per-block issue time calibrate measured on its host, else the fitted whole-step figure per block
    measured_tp = tp_microbatch_dispatch(local, compiled, calib) if tp > 1 else None
    issue = (measured_tp if measured_tp is not None
             else _tp_dispatch(local, tp, 1, compiled, p.async_tp, calib) if tp > 1
             else eager_dispatch_s(cfg, layers, 1, engine_kind(p.engine).autocast, compiled, calib))
    params = stage["params"]
    routed = sum(routed_params(cfg, i) for i in layers) if ep > 1 else 0
    # FSDP2's copies (stages run under FSDP2) on the rank's own parameters each micro-batch
    # (analytic.engine_step.fsdp_copy_bytes): torch's schedule turns the gradient sync off but the last micro-batch's,
    # so each gradient is cast to fp32 and added to the unsharded accumulator; under reshard_after_forward the
    # blocks are gathered again for each backward
    per_mb += fsdp_copy_bytes(1, 1 if p.reshard_after_forward else 1 / m) * (params - routed + routed / ep) / hbm
    device_mb, per_mb = per_mb, max(per_mb, issue)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * ((params - routed) / dp + routed / ep) / hbm
    # FSDP2 over the stage's data-parallel ranks (the routed experts left out under expert parallelism).
    # torch's schedule keeps the blocks gathered after each backward (set_reshard_after_backward(False)): with
    # reshard_after_forward a block is gathered again after each forward, about twice a micro-batch, else once
    # a schedule step; those gathers hide under the stage's compute but the first block's. The fp32
    # reduce-scatter runs once, after the stage's last backward (the stage's perform_reduce_grad), with no
    # compute left to hide under: :func:`pipeline_step` charges what the drain does not cover
    fsdp_s = final_rs = 0.0
    sharded = params - routed
    if dp > 1:  # the stage's data-parallel ranks, tp apart: across nodes when the stage is wider than a node
        across = dp * tp > G
        bw = calib.bus_bandwidth("all_gather", dp, across)
        gathers = 2 * m if p.reshard_after_forward else 1
        ag = gathers * 2 * sharded * (dp - 1) / dp / bw
        final_rs = gas * 4 * sharded * (dp - 1) / dp / calib.bus_bandwidth("reduce_scatter", dp, across)
        block = max(1, len(layers))
        fsdp_s = gas * (max(0.0, ag - m * per_mb) + (ag / gathers) / block)
    host = ov.get("step_s", 0.0) + gas * m * (ov.get("micro_batch_s", 0.0)
                                              + ov.get("fsdp_per_block_s", 0.0) * (len(layers) + 1))
    busy = gas * m * per_mb + optimizer + fsdp_s + host + ep_terms["comm/ep.replica_all_reduce_s"] + tp_step
    return {"rank": r, "layers": len(layers), "micro_batch_s": per_mb, "device_micro_batch_s": device_mb,
            "compute_s": compute, "optimizer_s": optimizer,
            "tp_exposed_s": gas * m * tp_mb + tp_step, "tp_dispatch_s": gas * m * issue if tp > 1 else 0.0,
            "fsdp_exposed_s": fsdp_s, "fsdp_final_reduce_scatter_s": final_rs, "host_s": host,
            "eager_dispatch_s": gas * m * issue if tp == 1 else 0.0, **ep_terms, "busy_s": busy}


def _assumptions(recipe: Recipe, kind, v_idle: int, m: int, crossing: float, dp: int, ep: int, G: int) -> list[str]:
    """What :func:`pipeline_step` assumed, in words."""
    cfg, t, p = recipe.model, recipe.train, recipe.parallel
    P, v, sched = p.pipeline_parallel, p.pipeline_virtual_stages, p.pipeline_schedule
    assumptions = [
        f"pipeline {sched} ({kind.source}): {P} ranks × {v} chunks, {m} micro-batches of "
        f"{t.micro_batch_size // m} sequences; idle {(P - 1) / v_idle * kind.bubble_work:.2g} "
        "micro-batch slots of the slowest rank per schedule step"
        + (f" (torch's {kind.torch_class} on {P} ranks idles as one chunk a rank does, measured on 4; the design: "
           f"{(P - 1) / v * kind.bubble_work:.2g})" if v_idle != v else ""),
        "point-to-point: the fill's and drain's sends exposed, the steady state's overlapped"
        + (f"; {crossing:.0%} of the stage boundaries between nodes" if crossing else ""),
        f"FSDP2 over {dp} data-parallel ranks per stage: "
        + ("blocks gathered again after each forward (parallel.reshard_after_forward), " if p.reshard_after_forward
           else "blocks gathered once a step, ")
        + "hidden under the stage's compute but the first; the fp32 reduce-scatter after the stage's last backward, "
        "exposed where the drain does not cover it",
    ]
    if p.tensor_parallel > 1:
        assumptions.append(
            f"tensor parallelism over {p.tensor_parallel} consecutive ranks within each stage (sequence-parallel): "
            "every collective on the critical path; the stage boundary carries each rank's sequence shard; the "
            "host's issue time per block on every micro-batch: as `scaletool calibrate --gpus 2 --recipe R` measured "
            "it on its host where the calibration has it, else the fitted whole-step TP dispatch per block (its "
            "head, loss and optimizer folded in); PP 2 x TP 2 on 4 H200s ran 3-7% faster than predicted on the "
            "host whose probe gave the H200 figure, 2-36% on two other hosts (docs/prediction.md): not validated")
    if ep > 1:
        assumptions.append(
            f"expert parallelism over {ep} ranks of each stage ({cfg.n_routed_experts // ep} experts each"
            + (", across nodes" if ep > G else ", within a node") + "): every all-to-all exposed; the routed "
            "experts' GEMMs at the grouped shape (every group rank's rows per local expert)"
            + (f"; the busiest rank receives {ep_analytic.EXPERT_IMBALANCE:g}x the mean routed rows"
               if cfg.moe_dispatch == "dropless" else "")
            + (f"; expert gradients all-reduced over {dp // ep} replicas" if dp > ep else ""))
    return assumptions


def pipeline_step(recipe: Recipe, calib: Calibration, *, world_size: int | None = None,
                  gpus_per_node: int | None = None, compiled: bool | None = None, designed_bubble: bool = False) -> dict:
    """Predicted step time of the recipe's pipeline layout, every term shown, the bounding rank named.

    The bubble is the one torch's schedule realises (:meth:`ScheduleKind.realised_chunks`: interleaved 1F1B on
    4 or more ranks idles as plain 1F1B does); ``designed_bubble``: the schedule's published one instead, for
    another project's implementation (the published-runs validation).

    Ranks are laid out pipeline-outermost (:mod:`scaletool.engines.pipeline`): a stage's ``dp`` data-parallel
    ranks are consecutive, so FSDP2's collectives cross nodes only when ``dp`` exceeds a node, and a stage
    boundary crosses nodes for ``min(1, dp / G)`` of the boundaries once the pipeline spans nodes."""
    # the FLOP counts, shared with predict_step
    from scaletool.analytic.step import _flops

    cfg, t, p = recipe.model, recipe.train, recipe.parallel
    P, v, sched = p.pipeline_parallel, p.pipeline_virtual_stages, p.pipeline_schedule
    N, tp = world_size or p.world_size, p.tensor_parallel
    if N % (P * tp):
        raise ValueError(f"pipeline_parallel={P} × tensor_parallel={tp} does not divide world_size={N}")
    dp, G = N // (P * tp), gpus_per_node or min(N, 8)
    ep = expert_degree(recipe, N)
    compiled = t.compile if compiled is None else compiled
    m, T, gas = pipeline_microbatches(recipe), recipe.seq_len, t.grad_accum_steps
    tokens = t.micro_batch_size // m * T
    split = stage_split(recipe, N)
    memory = stage_memory(recipe, N, split)
    ranks = [_rank_terms(recipe, r, layers, memory[r], N, G, compiled, calib)
             for r, layers in enumerate(rank_layers(recipe, split))]
    bound = max(ranks, key=lambda x: x["busy_s"])
    # fill and drain: the other ranks' slots, each at its own pace (1F1B's critical path (m - 1)·S_max + Σ S_r), / v
    slot = max(x["micro_batch_s"] for x in ranks)
    kind = schedule_kind(sched)
    v_idle = kind.realised_chunks(P, v, designed_bubble)
    # at the devices' pace: a host-bound rank's host issues on, the point-to-point waits being stream waits, so
    # its devices catch up on a fill or drain the host already issued
    dev = [x["device_micro_batch_s"] for x in ranks]
    bubble = gas * (sum(dev) - max(dev)) / v_idle * kind.bubble_work
    # crossings of the fill and the drain: p·v - 1 boundaries each way per schedule step, each one micro-batch's
    # activation (forward) or its gradient (backward), d 16-bit numbers per token (a rank's sequence shard under
    # tensor parallelism, its group's ranks sending theirs at once); a boundary between nodes (min(1, dp·tp/G) of
    # them once the pipeline spans nodes) at the inter-node bandwidth
    a = 2 if cfg.dtype != "fp32" else 4
    crossing = min(1.0, dp * tp / G) if N > G else 0.0
    message = a * tokens * cfg.d_model / tp
    send = message * ((1 - crossing) / calib.bus_bandwidth("all_reduce", 2, False)
                      + crossing / calib.bus_bandwidth("all_reduce", 2, True))
    p2p = gas * 2 * (P * v - 1) * send
    # each stage's final reduce-scatter starts after its last backward; rank r's comes r backward slots
    # (two thirds of a micro-batch's slot, a chunk's share under interleaving) before the first stage's, which ends
    # the schedule: what the drain does not cover is exposed
    final_rs = max(0.0, *(x["fsdp_final_reduce_scatter_s"] - x["rank"] * gas * 2 / 3 * slot / v for x in ranks))
    step = bound["busy_s"] + bubble + p2p + final_rs
    global_tokens = t.micro_batch_size * T * gas * dp
    ac = t.activation_checkpointing
    frac = 1.0 if ac == "full" else (cfg.n_layers // t.selective_every / cfg.n_layers if ac == "selective" else 0.0)
    model_flops, hw_flops = _flops(cfg, T, tokens, global_tokens, frac)
    peak = calib.peak_tflops * 1e12
    ep_keys = ("comm/ep.all_to_all_s", "ep/imbalance_s", "ep/host_sync_s", "ep/expert_gemm_shape_s",
               "comm/ep.replica_all_reduce_s")
    assumptions = _assumptions(recipe, kind, v_idle, m, crossing, dp, ep, G)
    return {
        "engine": p.engine, "world_size": N, "pipeline_parallel": P, "virtual_stages": v, "schedule": sched,
        "microbatches": m, "data_parallel": dp, "tensor_parallel": tp, "expert_parallel": ep, "gpus_per_node": G,
        "compiled": bool(compiled), "micro_batch_size": t.micro_batch_size, "grad_accum_steps": gas, "seq_len": T,
        "activation_checkpointing": t.activation_checkpointing, "split": [list(s) for s in split],
        "ranks": ranks, "bounding_rank": bound["rank"],
        "terms": {"pipeline/busy_s": bound["busy_s"], "pipeline/bubble_s": bubble, "pipeline/p2p_exposed_s": p2p,
                  "compute_s": bound["compute_s"], "optimizer_s": bound["optimizer_s"],
                  "comm/dp_exposed_s": bound["fsdp_exposed_s"], "comm/dp_final_reduce_scatter_s": final_rs,
                  "comm/tp_exposed_s": bound["tp_exposed_s"], "tp_dispatch_s": bound["tp_dispatch_s"],
                  "host_overhead_s": bound["host_s"],
                  **{k: bound[k] for k in ep_keys}},
        "bubble_fraction": bubble / step, "bubble_fraction_balanced": bubble_fraction(sched, P, v, m),
        "step_s": step, "tokens_per_step": global_tokens, "tokens_per_s": global_tokens / step,
        "tokens_per_s_per_gpu": global_tokens / step / N,
        "mfu": model_flops / (step * N * peak), "hfu": hw_flops / (step * N * peak),
        "bound": f"pipeline rank {bound['rank']}", "calibration": calib.source, "calibration_name": calib.name,
        "assumptions": assumptions,
    }


def pipeline_estimate(recipe: Recipe, world_size: int, calib: Calibration | None = None) -> tuple[dict, dict]:
    """``estimate``'s view of a pipeline layout: (the memory row of its largest stage, shaped as
    :func:`scaletool.analytic.memory.recipe_memory`'s, so every "this recipe" figure is per stage; the pipeline
    block: the split, every stage's blocks, memory and in-flight micro-batches, the balanced bubble, the stage
    that bounds memory and, with a calibration, the stage that bounds the step and the step's bubble)."""
    p = recipe.parallel
    split = stage_split(recipe, world_size)
    stages = stage_memory(recipe, world_size, split)
    top = max(stages, key=lambda x: x["total_bytes"])
    state = top["states_bytes"]  # 16 B per parameter: fp32 weight 4, gradient 4, AdamW m and v 8
    weights, grads, optim = state // 4 + top["gathered_bytes"], state // 4, state - 2 * (state // 4)
    buffers = top["p2p_buffers_bytes"]
    backward = {"weights": weights, "gradients": grads, "optimizer": optim, "activations": top["activations_bytes"],
                "buffers": buffers, "temporaries": 0}
    step = {**backward, "weights": state // 4, "activations": 0, "buffers": 0}
    row = {"engine": p.engine, "world_size": world_size, "zero_stage": None, "weights_bytes": weights,
           "gradients_bytes": grads, "optimizer_bytes": optim, "activations_bytes": top["activations_bytes"],
           "activations_per_token_per_layer_bytes": 0, "transient_bytes": buffers,
           "total_bytes": top["total_bytes"], "phases": {"backward": backward, "optimizer_step": step},
           "phase": "backward", "backward_peak_at": f"largest pipeline stage, rank {top['rank']}",
           "label": f"fsdp pp{p.pipeline_parallel}" + (f" tp{p.tensor_parallel}" if p.tensor_parallel > 1 else ""),
           "activation_checkpointing": recipe.train.activation_checkpointing}
    m = pipeline_microbatches(recipe)
    block = {"pipeline_parallel": p.pipeline_parallel, "schedule": p.pipeline_schedule,
             "virtual_stages": p.pipeline_virtual_stages, "microbatches": m,
             "data_parallel": world_size // (p.pipeline_parallel * p.tensor_parallel),
             "tensor_parallel": p.tensor_parallel, "expert_parallel": expert_degree(recipe, world_size),
             "split": [list(s) for s in split], "stages": stages, "memory_bound_stage": top["rank"],
             "bubble_fraction_balanced": bubble_fraction(p.pipeline_schedule, p.pipeline_parallel,
                                                         p.pipeline_virtual_stages, m)}
    if calib is not None:
        pred = pipeline_step(recipe, calib, world_size=world_size)
        block.update({"bounding_stage": pred["bounding_rank"], "bubble_fraction": pred["bubble_fraction"],
                      "step_s": pred["step_s"], "terms": pred["terms"]})
    return row, block
