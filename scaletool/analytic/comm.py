"""Communication: bytes per optimizer step of each engine's collectives, per rank and process group."""
from __future__ import annotations

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.analytic.collectives import _layer_params, _row
from scaletool.analytic.engines import kind_with_forms
from scaletool.analytic.params import param_counts
from scaletool.analytic.timeline import MemoryInputs
from scaletool.config import ModelConfig, Recipe
from scaletool.kinds.attention import attention_kind
from scaletool.kinds.engines import ENGINES

# ---------------------------------------------------------------------------------------------
# Communication
#
# Bytes per optimizer step of the collectives each engine issues, per rank, by process group:
# tensor parallelism (``tp``, scaletool.engines.tp: Megatron-LM's column/row split with sequence and
# loss parallelism) and the data-parallel engines (``dp``: DDP, FSDP2, ZeRO-0..3, expert parallelism's
# all-to-alls). A row is one kind of collective: how many per step (None where the library buckets them
# by size), their messages' bytes summed (a message is the full tensor: an all-gather's output, a
# reduce-scatter's input, an all-reduce's tensor) and the bytes each rank sends for them
# (:func:`wire_bytes`). scaletool.measure.collectives counts the same on a real process group.


def tensor_parallel_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one of ``tp`` tensor-parallel ranks holds, as a config: query and K/V heads (MQA's one
    K/V head stays whole), FFN width and vocabulary divided by ``tp``; d_model, head dims and MLA's
    latent ranks unchanged (replicated). :func:`param_counts` of it is that rank's parameter count, and
    its per-layer activations are that rank's inside the split sub-layers."""
    if tp == 1:
        return cfg
    kv = attention_kind(cfg).tp_kv_heads(cfg, tp)
    return cfg.model_copy(update={"n_heads": cfg.n_heads // tp, "n_kv_heads": kv,
                                  "intermediate_size": cfg.intermediate_size // tp, "vocab_size": cfg.vocab_size // tp})


def tensor_parallel_replicated(cfg: ModelConfig) -> list[int]:
    """Sizes of the weight tensors every tensor-parallel rank holds whole: the norms (sequence-parallel),
    MLA's latent path (wkv_a, kv_norm; wq_a, q_norm), MQA's K/V projections. Each gets one all-reduce of
    its partial gradients per step (engines.tp)."""
    d = cfg.d_model
    norm = [d] if cfg.norm == "rmsnorm" else [d, d]  # LayerNorm: weight and bias
    layer = 2 * norm + attention_kind(cfg).tp_replicated(cfg)
    return cfg.n_layers * layer + norm


def tensor_parallel_communication(cfg: ModelConfig, tp: int, inputs: MemoryInputs, grad_accum_steps: int = 1,
                                  pure: bool = False, first: bool = True, last: bool = True) -> list[dict]:
    """Tensor parallelism's collectives per optimizer step, per rank of a group of ``tp``.

    Sequence parallelism (Korthikanti et al. 2022, §4.2.2, Figure 5): each sub-layer (attention, FFN)
    starts with an all-gather of its normed input and ends with a reduce-scatter of its output, and the
    backward mirrors them (2 of each per sub-layer and micro-batch: the bandwidth of Megatron-LM's one
    all-reduce forward and one backward, Shoeybi et al. 2019, §3); a recomputed (checkpointed) block
    repeats its forward pair. The vocabulary-sharded embedding reduce-scatters its output (all-gather in
    the backward), the final norm's output is gathered for the head (reduce-scatter in the backward).
    Messages: micro_batch_size × seq_len × d_model in the compute dtype. Loss parallelism adds three
    all-reduces of micro_batch_size × seq_len fp32 numbers (max, sum of exponentials, target logit).
    Once per step the replicated weights' partial gradients are all-reduced, one per tensor, in the
    parameter dtype (fp32 when accumulating: FSDP2 keeps accumulated gradients in its reduce dtype).
    ``pure`` (tensor parallelism over every rank, no FSDP2: engines.fsdp's ``pure_tp``): those gradients are
    fp32 (the parameters' dtype under autocast) and go in one flat all-reduce.
    The global gradient norm's all-reduce of one number per tensor is left out. ``first``/``last`` False: a
    pipeline stage without the embedding / without the final norm and the loss (analytic.pipeline).
    """
    if tp == 1:
        return []
    L, gas = cfg.n_layers, grad_accum_steps
    ac = inputs.activation_checkpointing
    recomputed = L if ac == "full" else (L // inputs.selective_every if ac == "selective" else 0)
    tokens = inputs.micro_batch_size * inputs.seq_len
    activation = tokens * cfg.d_model * cfg.dtype_bytes
    # per op: blocks forward and backward, recompute, embedding and final norm
    per_micro = 4 * L + 2 * recomputed + int(first) + int(last)
    replicated = tensor_parallel_replicated(cfg)
    grad_bytes = 4 if gas > 1 or pure else cfg.dtype_bytes
    return [
        _row("tp", "all_gather", "sub-layer inputs, final norm; embedding (backward)", gas * per_micro,
             gas * per_micro * activation, tp),
        _row("tp", "reduce_scatter", "sub-layer outputs, embedding; final norm (backward)", gas * per_micro,
             gas * per_micro * activation, tp),
        *([_row("tp", "all_reduce", "loss parallelism (max, sum of exp, target logit)", 3 * gas, 3 * gas * tokens * 4,
                tp)] if last else []),
        _row("tp", "all_reduce", "replicated weights' gradients" + (", flat" if pure else ""),
             1 if pure else len(replicated), sum(replicated) * grad_bytes, tp),
    ]


def data_parallel_communication(cfg: ModelConfig, engine: str, ranks: int, *, zero_stage: int = 1,
                                grad_accum_steps: int = 1, reshard_after_forward: bool = True,
                                expert_parallel: bool | int = False, inputs: MemoryInputs | None = None,
                                reduce_scatter_every: str = "step") -> list[dict]:
    """The data-parallel engine's collectives per optimizer step, per rank of ``ranks`` (``cfg`` is what
    one rank of a tensor-parallel group holds, :func:`tensor_parallel_config`, when there is one).

    - DDP: one all-reduce of the fp32 gradients per step (``no_sync`` while accumulating), in buckets.
    - FSDP2: per micro-batch, each block's and the root's (embedding, final norm, head) 16-bit parameters
      all-gathered for the forward, the blocks again for the backward when ``reshard_after_forward`` (the
      root is not resharded); per step one reduce-scatter of the gradients per block and root, in fp32
      (the reduce dtype), or per micro-batch with ``reduce_scatter_every="micro-batch"``. Without FSDP2's
      padding of each tensor's first dimension to a multiple of ``ranks``. Expert parallelism (``inputs``
      needed; ``expert_parallel`` True over every rank, or the group's size): the routed experts stay out of
      FSDP2, and each MoE layer's routed rows go by all-to-all twice in the forward and twice in the backward
      (:func:`scaletool.analytic.expert_parallel.all_to_all_rows`).
    - ZeRO (Rajbhandari et al. 2020, §7): stage 0 all-reduces the 16-bit gradients once per step;
      stages 1 and 2 reduce-scatter them (stage 1 once per step, stage 2 every micro-batch: its gradients
      are partitioned as the backward produces them) and all-gather the updated 16-bit parameters after
      the step (2Ψ, as data parallelism); stage 3 all-gathers the parameters for every micro-batch's
      forward and backward and reduce-scatters its gradients (3Ψ per micro-batch).
    """
    if ranks == 1:
        return []
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}")
    return kind_with_forms(engine).part("communication")(
        cfg, ranks, zero_stage=zero_stage, grad_accum_steps=grad_accum_steps,
        reshard_after_forward=reshard_after_forward, expert_parallel=expert_parallel, inputs=inputs,
        reduce_scatter_every=reduce_scatter_every)


def hsdp_replicate_row(cfg: ModelConfig, shard: int, replicate: int, *, grad_accum_steps: int = 1,
                       reduce_scatter_every: str = "step") -> dict:
    """HSDP (FSDP2 on a 2-D ``(replicate, shard)`` mesh, Zhao et al. 2023 "PyTorch FSDP", §3.2.2 hybrid sharding):
    after each reduce-scatter inside the shard group, the rank's fp32 gradient shard (Ψ/shard) is all-reduced
    across the ``replicate`` ranks that hold the same shard, one per block and root, once per step (per
    micro-batch with ``reduce_scatter_every="micro-batch"``)."""
    blocks = len(_layer_params(cfg)) + 1
    reductions = grad_accum_steps if reduce_scatter_every == "micro-batch" else 1
    return _row("dp_replicate", "all_reduce", "gradient shards across replicas (HSDP, fp32)", reductions * blocks,
                reductions * 4 * param_counts(cfg)["total"] / shard, replicate)


def collective_group(group: str, world_size: int, tensor_parallel: int = 1, replicate: int = 1) -> tuple[int, int]:
    """(ranks, stride) of a row's process group in the row-major layout of :func:`scaletool.engines.dist.device_mesh`
    (``(replicate, shard, tp)``, the last dimension fastest): ``tp`` consecutive ranks; ``dp`` (the data-parallel
    or, under HSDP, the shard group) ``world_size / tp / replicate`` ranks ``tp`` apart; ``dp_replicate`` the
    replicas, a shard group's width apart."""
    dp = world_size // tensor_parallel
    if group == "tp":
        return tensor_parallel, 1
    if group == "dp":
        return dp // replicate, tensor_parallel
    if group == "dp_replicate":
        return replicate, dp // replicate * tensor_parallel
    raise ValueError(f"unknown process group {group!r}")


def communication(recipe: Recipe, world_size: int | None = None, tensor_parallel: int | None = None) -> dict:
    """Per-step communication of the recipe's engine at ``world_size`` ranks, ``tensor_parallel`` of them
    per tensor-parallel group (defaults: ``parallel.world_size``, ``parallel.tensor_parallel``); under HSDP
    (``parallel.data_parallel_replicate`` R > 1) FSDP2's collectives over the shard group of
    ``world_size / R`` ranks and :func:`hsdp_replicate_row` across the R replicas."""
    p, t = recipe.parallel, recipe.train
    tp = tensor_parallel or p.tensor_parallel
    N = world_size or p.world_size
    if N % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide world_size={N}")
    dp = N // tp
    R = p.data_parallel_replicate
    if dp % R:
        raise ValueError(f"data_parallel_replicate={R} does not divide the {dp} data-parallel ranks")
    shard = dp // R
    inputs = MemoryInputs(t.micro_batch_size, recipe.seq_len, t.activation_checkpointing, t.selective_every)
    local = tensor_parallel_config(recipe.model, tp)
    rows = tensor_parallel_communication(recipe.model, tp, inputs, t.grad_accum_steps,
                                         pure=p.pure_tensor_parallel(N, tp))
    rows += data_parallel_communication(local, p.engine, shard, zero_stage=p.zero_stage, grad_accum_steps=t.grad_accum_steps,
                                        reshard_after_forward=p.reshard_after_forward,
                                        expert_parallel=ep_analytic.degree(p.expert_parallel, p.expert_parallel_degree,
                                                                           dp) if p.expert_parallel else False,
                                        inputs=inputs, reduce_scatter_every=p.reduce_scatter_every)
    if R > 1:
        rows.append(hsdp_replicate_row(local, shard, R, grad_accum_steps=t.grad_accum_steps,
                                       reduce_scatter_every=p.reduce_scatter_every))
    by_group = {g: sum(r["wire_bytes"] for r in rows if (r["group"] == "tp") == (g == "tp")) for g in ("tp", "dp")}
    return {"engine": p.engine, "world_size": N, "tensor_parallel": tp, "data_parallel": dp,
            "data_parallel_replicate": R, "data_parallel_shard": shard, "collectives": rows,
            "tp_wire_bytes": by_group["tp"], "dp_wire_bytes": by_group["dp"],
            "wire_bytes": by_group["tp"] + by_group["dp"]}
