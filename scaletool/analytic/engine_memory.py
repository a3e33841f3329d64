"""Per-engine peak memory along the backward timeline: torch engines (single, DDP, FSDP2) and ZeRO-1/2/3."""
from __future__ import annotations

from scaletool.analytic.params import moe_params, param_counts
from scaletool.analytic.timeline import EngineSettings, _group_sizes, _timeline
from scaletool.analytic.zero3 import persistent_params


def _torch_engine(cfg, shard, hooks, units, loss_temp, s: EngineSettings) -> dict:
    """single, DDP, FSDP2: fp32 parameters, gradients and AdamW m, v (16Ψ), FSDP2 sharding all of it.

    - single: gradients appear as the backward produces them and are freed after the step.
    - DDP (``gradient_as_bucket_view``): the reducer's flat buckets are the gradients (4Ψ), plus one fresh
      gradient at a time, and, once per run, the second set of buckets the second step rebuilds in
      arrival order while the first is still held: the run's peak counts it.
    - FSDP2: sharded fp32 gradients appear as each reduce-scatter finishes; the root stays unsharded
      through the backward; at a block, its and the prefetched block's unsharded 16-bit parameters, its
      unsharded gradients and the fp32 reduce-scatter input.
    - Step: fused AdamW adds nothing; foreach AdamW one fp32 temporary per parameter of the larger group.

    ``shard``: the ranks the states are sharded over (1 unsharded); ``hooks``: the engine's
    (gradients, buffers) at each stop of the backward.
    """
    psi = param_counts(cfg)["total"]
    states = {"weights": 4 * psi / shard, "optimizer": 8 * psi / shard}
    grads_at, buffers_at = hooks
    backward, where = _timeline(units, loss_temp, states, grads_at, buffers_at)
    temp = 0.0 if s.fused_optimizer else 4 * max(_group_sizes(cfg)) / shard
    step = {**states, "gradients": 4 * psi / shard, "activations": 0.0, "buffers": 0.0, "temporaries": temp}
    return {"phases": {"backward": backward, "optimizer_step": step}, "backward_peak_at": where,
            "weights_bytes": states["weights"], "gradients_bytes": 4 * psi / shard, "optimizer_bytes": states["optimizer"]}


def _zero12(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """DeepSpeed ZeRO-1/2 as scaletool configures it: 16-bit parameters whole (2Ψ), fp32 master, m, v
    sharded (12Ψ/N), contiguous_gradients and overlap_comm on.

    Backward: the IPG buckets (2 × reduce_bucket 16-bit elements with overlap_comm) and, from the first
    bucket flush, this rank's 16-bit gradient partition (Ψ/N; stage 1 without overlap_comm keeps 2Ψ).
    Step: per group, a flat 16-bit copy of the partition and its fp32 cast (2P + 4P for the larger group;
    an fp32 model skips the cast); the all-gather of updated partitions writes in place. Stage 0 runs
    DeepSpeed's FP16_Optimizer, which casts and flattens every gradient (4P + 4P).
    Source: deepspeed/runtime/zero/stage_1_and_2.py (``DeepSpeedZeroOptimizer``).
    """
    psi = param_counts(cfg)["total"]
    mixed = cfg.dtype != "fp32"
    g16 = cfg.dtype_bytes if mixed else 4
    stage0 = s.zero_stage == 0
    shards = 1 if stage0 else N
    partitioned = not stage0 and (s.zero_stage >= 2 or s.overlap_comm)
    grad_bytes = g16 * psi / (N if partitioned else 1)
    states = {"weights": g16 * psi, "optimizer": (12 if mixed else 8) * psi / shards}
    buckets = 0 if stage0 else (2 if s.overlap_comm else 1) * s.reduce_bucket * g16
    last = len(units) - 1

    def grads_at(i, done):
        if not partitioned:  # stage 0, or stage 1 without overlap: every gradient stays in param.grad
            return g16 * done
        return grad_bytes if (done > s.reduce_bucket or i == last) else 0.0

    def buffers_at(i): return buckets if i >= 0 else 0.0

    backward, where = _timeline(units, loss_temp, states, grads_at, buffers_at)
    P = max(_group_sizes(cfg)) / shards
    if stage0:  # every gradient cast to fp32 one by one, then flattened: 4P + 4P
        temp = 8 * P
    else:
        temp = max((g16 + (4 if mixed else 0)) * P, (4 + (0 if s.fused_optimizer else 4)) * P)
    step = {**states, "gradients": grad_bytes, "activations": 0.0, "buffers": 0.0, "temporaries": temp}
    return {"phases": {"backward": backward, "optimizer_step": step}, "backward_peak_at": where,
            "weights_bytes": states["weights"], "gradients_bytes": grad_bytes, "optimizer_bytes": states["optimizer"]}


def _zero3(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py, ``DeepSpeedZeroOptimizer_Stage3``):
    16-bit parameter partitions (2Ψ/N), fp32 master, m, v (12Ψ/N), and two buffers allocated for good
    in ``_setup_for_real_optimizer``: the flat 16-bit gradient partitions (2Ψ/N,
    ``grad_partitions_flat_buffer``) and the contiguous IPG bucket (reduce_bucket 16-bit elements).

    - Backward: gathered 16-bit parameters (partitioned_param_coordinator.py; none on one rank, where
      partition_parameters.py ``all_gather_coalesced`` hands out the partition itself). A parameter used again
      within ``max_reuse_distance`` gathered elements is not released: those used last in the forward,
      needed first in the backward, stay gathered from forward to backward (the stops whose earlier stops
      sum to under max_reuse_distance/2); each stop's own parameters and the prefetched next stops' (up to
      prefetch_bucket elements, scaletool's default two blocks: :mod:`scaletool.analytic.zero3`) are
      gathered while it runs. Parameters of at most ``stage3_param_persistence_threshold`` elements (norm
      weights, biases) stay whole on every rank, counted with the weights. A bucket flush (``__reduce_and_partition_ipg_grads``
      → ``reduce_scatter_coalesced``) concatenates the bucket's gradients into one 16-bit buffer (torch.cat).
    - Step: ``_partition_all_parameters`` releases what is gathered; per sub-group
      (``_prepare_fp32_grad_for_sub_group``) ``flatten(...).to(fp32)`` makes a 16-bit flat copy and the fp32
      gradient of the sub-group's partition, P = min(group, sub_group_size) elements / N: 2P + 4P.
    """
    psi = param_counts(cfg)["total"]
    mixed = cfg.dtype != "fp32"
    g16 = cfg.dtype_bytes if mixed else 4
    persistent = persistent_params(cfg, s.persistence_threshold) if N > 1 else 0
    states = {"weights": g16 * (psi - persistent) / N + g16 * persistent, "optimizer": (12 if mixed else 8) * psi / N}
    grad_bytes = g16 * psi / N
    bucket = s.reduce_bucket * g16
    kept, before = [], 0
    for u in units[:-1]:  # the embedding is used first in the forward, last in the backward: never kept
        kept.append(2 * before < s.max_reuse_distance)
        before += u.gathered
    kept.append(False)
    last = len(units) - 1

    def gathered_at(i):
        if N == 1:  # one rank: the "gathered" parameter is its partition (all_gather_coalesced -> NoGatherHandle)
            return 0
        if i < 0:
            return sum(u.gathered for u, k in zip(units, kept) if k)
        pending = sum(u.gathered for u, k in zip(units[i + 1:], kept[i + 1:]) if k)
        ahead = sum(u.gathered for u, k in zip(units[i + 1:], kept[i + 1:]) if not k)
        return pending + units[i].gathered + min(ahead, s.prefetch_bucket)

    flushes, fill = {}, 0  # stop -> elements flushed there (the bucket's content)
    for i, u in enumerate(units):
        if fill + u.params > s.reduce_bucket:
            flushes[i], fill = fill, 0
        fill += u.params
    flushes[last] = flushes.get(last, 0) + fill

    def grads_at(i, done): return grad_bytes
    def buffers_at(i): return bucket + g16 * gathered_at(i)
    def temp_at(i, done): return g16 * flushes.get(i, 0) if i >= 0 else 0.0

    backward, where = _timeline(units, loss_temp, states, grads_at, buffers_at, temp_at)
    P = min(max(_group_sizes(cfg)), s.sub_group_size) / N
    temp = max((g16 + (4 if mixed else 0)) * P, (4 + (0 if s.fused_optimizer else 4)) * P)
    step = {**states, "gradients": grad_bytes, "activations": 0.0, "buffers": bucket, "temporaries": temp}
    return {"phases": {"backward": backward, "optimizer_step": step}, "backward_peak_at": where,
            "weights_bytes": states["weights"], "gradients_bytes": grad_bytes, "optimizer_bytes": states["optimizer"]}


def single_memory(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """engine=single: gradients as the backward produces them, no buffers (see :func:`_torch_engine`);
    with gradient accumulation every gradient is held from the first micro-batch on, so the later
    micro-batches' backward peaks with all of them."""
    psi = param_counts(cfg)["total"]
    def grads_at(i, done): return 4 * psi if s.grad_accum_steps > 1 else 4 * done
    def buffers_at(i): return 0.0
    return _torch_engine(cfg, 1, (grads_at, buffers_at), units, loss_temp, s)


def ddp_memory(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """engine=ddp: the reducer's buckets are the gradients, plus one fresh gradient and a second set of
    buckets once per run (see :func:`_torch_engine`)."""
    psi = param_counts(cfg)["total"]
    def grads_at(i, done): return 4 * psi
    def buffers_at(i): return 4 * psi + (4 * units[i].largest if i >= 0 else 0.0)
    return _torch_engine(cfg, 1, (grads_at, buffers_at), units, loss_temp, s)


def fsdp_memory(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """engine=fsdp: states sharded over N ranks, gathered 16-bit parameters and reduce-scatter buffers
    per block (see :func:`_torch_engine`). With gradient accumulation the engine turns gradient sync off
    for all but the last micro-batch, and FSDP2 then keeps every parameter's gradient unsharded in its
    fp32 reduce dtype between micro-batches (``FSDPParam.to_accumulated_grad_if_needed``): 4Ψ per rank,
    not 4Ψ/N, until the last micro-batch's reduce-scatters (expert-parallel experts: only this rank's);
    ``parallel.reduce_scatter_every=micro-batch`` keeps sync on and holds sharded gradients only."""
    p = cfg.dtype_bytes if cfg.dtype != "fp32" else 4
    root = units[0].gathered + units[-1].gathered
    blocks = [u.gathered for u in units[1:-1]]
    held = 0.0
    if s.grad_accum_steps > 1 and not s.reduce_scatter_every_micro_batch:
        routed = moe_params(cfg)["routed"] * cfg.n_moe_layers if cfg.n_moe_layers and s.expert_parallel else 0
        held = 4 * (param_counts(cfg)["total"] - routed * (1 - 1 / N))

    def grads_at(i, done): return max(held, 4 * done / N)

    def buffers_at(i):
        if i < 0:  # the root is still gathered from the forward; without resharding, every block too
            return p * root + (0 if s.reshard_after_forward else p * sum(blocks))
        waiting = p * units[0].params  # the head's unsharded gradient waits for the root's reduce-scatter
        if i == 0:
            return p * root + waiting + (0 if s.reshard_after_forward else p * sum(blocks))
        if i == len(units) - 1:  # the root's reduce-scatter: its unsharded gradients and the fp32 input
            return p * root + (p + 4) * root
        b = i - 1
        gathered = sum(blocks[b:]) if not s.reshard_after_forward else blocks[b] + sum(blocks[b + 1:b + 2])
        return p * root + waiting + p * gathered + (p + 4) * blocks[b]
    return _torch_engine(cfg, N, (grads_at, buffers_at), units, loss_temp, s)


def zero_memory(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """engine=deepspeed at its ZeRO stage: :func:`_zero3` for stage 3, :func:`_zero12` for 0-2."""
    return (_zero3 if s.zero_stage >= 3 else _zero12)(cfg, N, units, loss_temp, s)
