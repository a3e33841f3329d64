"""The data-parallel engines' collectives per optimizer step, per rank: one form per engine, provided to its
kind by :mod:`scaletool.analytic.engines`, and the row every collective is written as.

A row is one kind of collective: how many per step (None where the library buckets them by size), their
messages' bytes summed (a message is the full tensor: an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor) and the bytes each rank sends for them (:func:`wire_bytes`).
scaletool.measure.collectives counts the same on a real process group.
"""
from __future__ import annotations

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.analytic.params import _norm_params, attention_params, ffn_params, moe_params, param_counts
from scaletool.analytic.timeline import ZERO_REDUCE_BUCKET, MemoryInputs
from scaletool.analytic.zero3 import REDUCE_BLOCKS
from scaletool.config import ModelConfig


def wire_bytes(op: str, message_bytes: float, ranks: int) -> float:
    """Bytes each of ``ranks`` ranks sends for one collective on a ``message_bytes`` message, in the
    bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention,
    nccl-tests PERFORMANCE.md): all-reduce 2(n-1)/n·S, all-gather, reduce-scatter and all-to-all
    (n-1)/n·S; nothing on one rank."""
    factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}[op]
    return factor * (ranks - 1) / ranks * message_bytes


def _row(group: str, op: str, what: str, count: int | None, message_bytes: float, ranks: int) -> dict:
    return {"group": group, "op": op, "what": what, "count": count, "message_bytes": int(message_bytes),
            "wire_bytes": int(wire_bytes(op, message_bytes, ranks))}


def _layer_params(cfg: ModelConfig, expert_parallel: bool = False) -> list[int]:
    """Parameters of each block (what FSDP2 gathers per block); routed experts left out under expert
    parallelism (FSDP2 ignores them)."""
    attn = sum(attention_params(cfg).values()) + 2 * _norm_params(cfg, cfg.d_model)
    dense = attn + ffn_params(cfg)
    if not cfg.n_moe_layers:
        return [dense] * cfg.n_layers
    moe = moe_params(cfg)
    moe_layer = attn + moe["gate"] + moe["shared"] + (0 if expert_parallel else moe["routed"])
    return [dense] * (cfg.n_layers - cfg.n_moe_layers) + [moe_layer] * cfg.n_moe_layers


def no_communication(cfg: ModelConfig, ranks: int, **_) -> list[dict]:
    """One process: no collectives."""
    return []


def ddp_communication(cfg: ModelConfig, ranks: int, **_) -> list[dict]:
    """DDP: one all-reduce of the fp32 gradients per step, in buckets."""
    return [_row("dp", "all_reduce", "gradients (fp32, bucketed)", None, 4 * param_counts(cfg)["total"], ranks)]


def zero_communication(cfg: ModelConfig, ranks: int, *, zero_stage: int = 1, grad_accum_steps: int = 1, **_
                       ) -> list[dict]:
    """ZeRO's collectives at its stage (see :func:`data_parallel_communication`)."""
    gas, p16, psi = grad_accum_steps, cfg.dtype_bytes, param_counts(cfg)["total"]
    if zero_stage == 0:
        return [_row("dp", "all_reduce", "gradients", None, p16 * psi, ranks)]
    if zero_stage < 3:  # buckets of reduce_bucket_size elements (allgather_bucket_size: DeepSpeed's same 5e8)
        reduces, buckets = (gas if zero_stage == 2 else 1), -(-psi // ZERO_REDUCE_BUCKET)
        return [_row("dp", "reduce_scatter", "gradients", reduces * buckets, reduces * p16 * psi, ranks),
                _row("dp", "all_gather", "updated parameters", buckets, p16 * psi, ranks)]
    # one gather per block (a leaf module: analytic.zero3), embedding and head, forward and backward; gradients
    # reduced every REDUCE_BLOCKS blocks
    L = cfg.n_layers
    return [_row("dp", "all_gather", "parameters (forward and backward)", 2 * gas * (L + 1), 2 * gas * p16 * psi, ranks),
            _row("dp", "reduce_scatter", "gradients", gas * (-(-L // REDUCE_BLOCKS) + 1), gas * p16 * psi, ranks)]


def fsdp_communication(cfg: ModelConfig, ranks: int, *, grad_accum_steps: int = 1, reshard_after_forward: bool = True,
                       expert_parallel: bool | int = False, inputs: MemoryInputs | None = None,
                       reduce_scatter_every: str = "step", **_) -> list[dict]:
    """FSDP2's all-gathers and reduce-scatters, and expert parallelism's all-to-alls (see
    :func:`data_parallel_communication`)."""
    gas, p16 = grad_accum_steps, cfg.dtype_bytes  # 16-bit parameters under mixed precision, else fp32
    pc = param_counts(cfg)
    blocks = _layer_params(cfg, expert_parallel)
    root = pc["embedding"] + pc["head"] + pc["final_norm"]
    gathers = gas * (len(blocks) * (2 if reshard_after_forward else 1) + 1)
    gathered = gas * (sum(blocks) * (2 if reshard_after_forward else 1) + root)
    reductions = gas if reduce_scatter_every == "micro-batch" else 1
    rows = [_row("dp", "all_gather", "parameters (blocks and root)", gathers, gathered * p16, ranks),
            _row("dp", "reduce_scatter", "gradients (fp32)", reductions * (len(blocks) + 1),
                 reductions * 4 * (sum(blocks) + root), ranks)]
    if expert_parallel and cfg.n_moe_layers:  # expert parallelism's all-to-alls: scaletool.analytic.expert_parallel
        P = ranks if expert_parallel is True else int(expert_parallel)
        rows += ep_analytic.all_to_all_rows(cfg, inputs.micro_batch_size * inputs.seq_len, gas, P,
                                            _recomputed_moe_layers(cfg, inputs))
    return rows


def _recomputed_moe_layers(cfg: ModelConfig, inputs: MemoryInputs) -> int:
    """MoE blocks whose forward (and its all-to-alls) runs again in the backward under checkpointing."""
    ac, L = inputs.activation_checkpointing, cfg.n_layers
    if ac == "full":
        return cfg.n_moe_layers
    if ac != "selective":
        return 0
    return sum(1 for i in range(L - cfg.n_moe_layers, L) if (i + 1) % inputs.selective_every == 0)
