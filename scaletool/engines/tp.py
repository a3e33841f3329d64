"""Tensor parallelism: each layer's heads and FFN width split over ``parallel.tensor_parallel`` ranks.

Megatron-LM's scheme on DTensor, applied to the built model from outside (as torchtitan's
``parallelize``): head-producing projections column-parallel, head-consuming ones row-parallel, with
sequence parallelism between sub-layers (all-gather in, reduce-scatter out). Inside a sub-layer
everything is local, so attention runs the one-GPU SDPA kernels on per-rank heads (:class:`AttentionPlan`).
Parts every head shares (MQA's K/V head, MLA's latent down-projections) are replicated; their per-rank
partial gradients are declared ``Partial`` (:class:`ReplicateInRegion`, :class:`ColwiseInRegion`).
Embedding and LM head split over the vocabulary, with loss parallelism (logits never gathered).
TP groups are neighbouring ranks; FSDP2 shards over the groups (:func:`~scaletool.engines.dist.device_mesh`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scaletool.config import ModelConfig
from scaletool.engines.tp_local import localize_block, localize_root

_PARTIAL = (Partial(),)


class _ReplicateWithPartialGrad(torch.autograd.Function):
    """``DTensor.from_local(x, mesh, [Replicate()])`` whose backward hands back the gradient as this rank's
    partial sum instead of all-reducing it to ``Replicate``. ``from_local`` takes ``grad_placements`` only
    from torch 2.12 on; this one path runs the same on every torch (the floor, 2.11, included)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if grad.placements == _PARTIAL:  # what the region's ops hand back
            return grad.to_local(), None
        # a gradient whole on every rank (how torch.compile first traces this backward): each rank's 1/N share;
        # redistributing to Partial directly is refused outside DTensor's internals
        whole = grad.redistribute(placements=(Replicate(),)).to_local()
        return whole / grad.device_mesh.size(), None


def _local_in(x, mesh: DeviceMesh):
    """A plain tensor that holds the same value on every rank of the region, as a Replicate DTensor whose
    gradient stays a per-rank partial sum (reduced once, at the region's entry)."""
    if isinstance(x, DTensor):
        return x
    return _ReplicateWithPartialGrad.apply(x, mesh)


class ReplicateInRegion(ParallelStyle):
    """A module every rank of the group runs whole (its weights replicated) on the region's shared input;
    its output feeds this rank's heads, so its output gradient is a partial sum (torchtitan's
    ``NoParallel``, with local outputs)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(  # no partition_fn: parameters are replicated (broadcast from rank 0)
            module, device_mesh,
            input_fn=lambda mod, inputs, mesh: (_local_in(inputs[0], mesh), *inputs[1:]),
            output_fn=lambda mod, out, mesh: out.to_local(grad_placements=_PARTIAL))


class ColwiseInRegion(ColwiseParallel):
    """``ColwiseParallel`` for a head projection whose input comes from a replicated module of the same
    region (MLA's ``wkv_b`` after ``kv_norm``, ``wq_b`` after ``q_norm``): its input gradient stays partial."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        return _local_in(inputs[0], device_mesh)


class GatheredSequenceParallel(SequenceParallel):
    """The final norm: sequence-parallel, its output gathered (``Replicate``) for the column-parallel head."""

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=(Replicate(),))


# ---------------------------------------------------------------------------------------------
# Plans, keyed by attention kind


@dataclass(frozen=True)
class AttentionPlan:
    """How one attention kind splits: styles by submodule name (relative to the attention module) and
    the module attributes that hold head counts, with their per-rank values."""
    styles: dict[str, ParallelStyle]
    local: dict[str, int] = field(default_factory=dict)


def _sublayer_input(n_args: int) -> PrepareModuleInput:
    """The region's entry: the sequence-sharded normed input gathered (Replicate), kept a DTensor so the
    gradients of every projection reading it add up as partial sums and leave as one reduce-scatter."""
    rest = (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def _row_out() -> RowwiseParallel:
    """The region's exit: partial sums of the heads (or FFN columns) reduce-scattered onto the sequence shards."""
    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)


def _heads_plan(cfg: ModelConfig, tp: int) -> AttentionPlan:
    """MHA and GQA: q, k, v heads column-parallel, wo row-parallel (Megatron-LM §3, Figure 3b)."""
    styles = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": _row_out()}
    return AttentionPlan(styles, {"n_heads": cfg.n_heads // tp, "n_kv_heads": cfg.n_kv_heads // tp})


def _mqa_plan(cfg: ModelConfig, tp: int) -> AttentionPlan:
    """MQA: query heads split; the one K/V head is replicated (every rank's heads read it)."""
    styles = {"wq": ColwiseParallel(), "wk": ReplicateInRegion(), "wv": ReplicateInRegion(), "wo": _row_out()}
    return AttentionPlan(styles, {"n_heads": cfg.n_heads // tp})


def _mla_plan(cfg: ModelConfig, tp: int) -> AttentionPlan:
    """MLA: query heads and the latent up-projection ``wkv_b`` column-parallel, ``wo`` row-parallel; the
    latent (``wkv_a``, ``kv_norm``) and the shared RoPE key are one per token for all heads, so they are
    replicated, as are the low-rank query's ``wq_a`` and ``q_norm`` (torchtitan's DeepSeek-V3 plan)."""
    styles: dict[str, ParallelStyle] = {"wkv_a": ReplicateInRegion(), "kv_norm": ReplicateInRegion(),
                                        "wkv_b": ColwiseInRegion(), "wo": _row_out()}
    if cfg.q_lora_rank:
        styles.update(wq_a=ReplicateInRegion(), q_norm=ReplicateInRegion(), wq_b=ColwiseInRegion())
    else:
        styles["wq"] = ColwiseParallel()
    return AttentionPlan(styles, {"n_heads": cfg.n_heads // tp})


#: attention kind (``scaletool.kinds.attention.ATTENTION_KINDS``) -> its tensor-parallel plan; the kind's
#: ``tp_problems``, ``tp_kv_heads`` and ``tp_replicated`` state the same split for config and analytic
ATTENTION_PLANS: dict[str, Callable[[ModelConfig, int], AttentionPlan]] = {
    "mha": _heads_plan, "gqa": _heads_plan, "mqa": _mqa_plan, "mla": _mla_plan}


def _ffn_styles(cfg: ModelConfig) -> dict[str, ParallelStyle]:
    """SwiGLU: gate and up projections (w1, w3) column-parallel, w2 row-parallel; GELU/ReLU: w1, w2."""
    styles: dict[str, ParallelStyle] = {"ffn": _sublayer_input(1), "ffn.w1": ColwiseParallel(), "ffn.w2": _row_out()}
    if cfg.ffn == "swiglu":
        styles["ffn.w3"] = ColwiseParallel()
    return styles


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, cfg: ModelConfig, local_ops: bool = False) -> None:
    """Split ``model`` (a built, initialised :class:`~scaletool.model.transformer.Transformer`, the same
    weights on every rank, or a pipeline stage's :class:`~scaletool.engines.pipeline.StageModule`: the
    parts it holds) over the 1-D ``mesh`` in place. Call before activation checkpointing, compile and
    FSDP2 (torchtitan's order). ``local_ops``: the blocks run on local tensors, the same split
    (:mod:`scaletool.engines.tp_local`)."""
    root: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        # vocabulary-sharded: masked lookups, partial sums reduce-scattered onto the sequence shards
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                 use_local_output=False)
    if getattr(model, "norm", None) is not None:
        root["norm"] = GatheredSequenceParallel()
    if getattr(model, "output", None) is not None:
        # lm_head calls this module (a tied head: F.linear with the embedding's weight, sharded the same
        # way): on the gathered normed states either gives vocabulary-sharded logits
        root["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if root:
        parallelize_module(model, mesh, root)
    if local_ops and "tok_embeddings" in root:
        localize_root(model, mesh)
    plan = ATTENTION_PLANS[cfg.attention](cfg, mesh.size())
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        styles = {"attn_norm": SequenceParallel(), "attn": _sublayer_input(3), "ffn_norm": SequenceParallel(),
                  **{f"attn.{name}": style for name, style in plan.styles.items()}, **_ffn_styles(cfg)}
        if local_ops:
            localize_block(block, mesh, styles)
        else:
            parallelize_module(block, mesh, styles)
        for name, value in plan.local.items():
            setattr(block.attn, name, value)


def enable_async_tp(mesh: DeviceMesh) -> None:
    """Async TP (torchtitan's ``enable_async_tensor_parallel``): inductor's micro-pipeline pass rewrites
    each all-gather -> matmul and matmul -> reduce-scatter of the compiled blocks into fused ops that
    move chunks through symmetric memory (CUDA P2P) while the matmul of the previous chunk runs. The
    pass acts only on groups with symmetric memory enabled. NVLink multicast is not needed: it is used
    only where the driver reports it, for small all-gather-matmuls (≤ 2048 rows); otherwise the P2P path."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    inductor_config._micro_pipeline_tp = True
    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)  # later torch enables it on first use
    if enable is not None:
        enable(mesh.get_group().group_name)

