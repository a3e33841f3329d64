"""Expert parallelism: the all-to-all's bytes, the routed tokens' buffers and the step terms it adds.

Layout (``scaletool.engines.expert_parallel``): the D data-parallel ranks form groups of P
(``parallel.expert_parallel_degree``, 0 = D); each rank of a group keeps E/P routed experts, replicated
across the D/P groups. Per MoE layer and micro-batch a rank sends its routed rows to the experts' ranks and
gets the outputs back: two all-to-alls forward, two backward (their gradients), two more in a checkpointed
block's recomputed forward.

- Capacity dispatch: every piece is C slots per expert (E·C·d per all-to-all, equal on every rank).
- Dropless dispatch: a rank sends its own k·tokens rows (every assignment once), but receives what its
  experts were chosen for: the busiest rank of a group receives ρ times the mean, ρ the rank's load over the
  group's mean. Its grouped GEMMs, their saved activations and the receive buffers scale with ρ, and every
  other rank waits for it at the returning all-to-all. ρ is bounded by the measured expert imbalance
  (``moe/imbalance_ratio_max`` of a run; a rank's load averages E/P experts' loads, so it is at most the
  busiest expert's ratio); :data:`EXPERT_IMBALANCE` is what the committed dropless runs measured.
- The dropless dispatch first exchanges the E counts (an all-to-all of E·8 bytes) and reads the split sizes on
  the host: one device-to-host sync per MoE layer and forward, after which the host has no queued work to
  hide its launches behind (the backward reuses the sizes).

Torch-free and IO-free: pure functions of the model config, the layout and the calibration's rates.
"""
from __future__ import annotations

from scaletool.analytic.flops import routed_experts_computed
from scaletool.analytic.params import moe_params
from scaletool.config import ModelConfig, expert_capacity
from scaletool.kinds.engines import engine_kind

#: The busiest expert's assignments over the mean, measured on dropless mla-1b + 16 experts top-2 (the
#: moe-speed study, benchmarks/results/moe-speed/h100-2026-11-27-1/moe-a1.json: moe/imbalance_ratio_mean
#: 1.35 over the MoE layers, balance loss α = 0.001). The default ρ of the dropless estimates.
EXPERT_IMBALANCE = 1.35
#: Host seconds lost per dropless MoE layer and forward to the split sizes' device-to-host read: the
#: launch queue drains and refills (a CUDA sync plus restarting the CPU ahead of the GPU; tens of µs on
#: H100 hosts). Assumed, not calibrated; stated in the step's assumptions.
HOST_SYNC_S = 60e-6


def degree(expert_parallel: bool, expert_parallel_degree: int, data_parallel: int) -> int:
    """Ranks the routed experts are split over: ``expert_parallel_degree`` (0: every data-parallel rank)
    when expert parallelism is on, else 1."""
    if not expert_parallel:
        return 1
    return expert_parallel_degree or data_parallel


def problems(n_experts: int, data_parallel: int, ep_degree: int) -> list[str]:
    """Why groups of ``ep_degree`` ranks cannot split ``n_experts`` experts among ``data_parallel`` ranks
    (empty when they can): one line each, named by the recipe key."""
    out = []
    if data_parallel % ep_degree:
        out.append(f"parallel.expert_parallel_degree: {ep_degree} does not divide the {data_parallel} data-parallel "
                   "ranks (an expert-parallel group is that many consecutive ranks)")
    if n_experts % ep_degree:
        out.append(f"parallel.expert_parallel: {n_experts} routed experts do not split over {ep_degree} ranks")
    return out


def rows_received(cfg: ModelConfig, tokens: int, ep_degree: int, imbalance: float = EXPERT_IMBALANCE) -> float:
    """Routed rows the busiest rank of a group computes per MoE layer and micro-batch of ``tokens`` tokens
    per rank: capacity, E·C (every rank's C slots of its E/P experts from P ranks); dropless, ρ·k·tokens."""
    if cfg.moe_dispatch == "capacity":
        return float(cfg.n_routed_experts * expert_capacity(cfg, tokens))
    mean = tokens * cfg.num_experts_per_tok
    return mean * (imbalance if ep_degree > 1 else 1.0)


def all_to_all_rows(cfg: ModelConfig, tokens: int, grad_accum_steps: int, ep_degree: int, recomputed_layers: int = 0
                    ) -> list[dict]:
    """The all-to-alls of one optimizer step on one rank, as :mod:`scaletool.analytic.comm` rows (group ``dp``,
    ``ranks`` the expert-parallel group). A message is what one rank sends: its routed rows × d_model in the
    compute dtype (capacity: the whole E·C buffer); dispatch and return forward, their gradients backward,
    and again in the forward of ``recomputed_layers`` checkpointed MoE blocks. Dropless adds the counts'
    exchange (E int64) per layer and forward."""
    if ep_degree == 1 or not cfg.n_moe_layers:
        return []
    a = cfg.dtype_bytes
    rows = (cfg.n_routed_experts * expert_capacity(cfg, tokens) if cfg.moe_dispatch == "capacity"
            else tokens * cfg.num_experts_per_tok)
    forwards = grad_accum_steps * (cfg.n_moe_layers + recomputed_layers)
    count = 2 * forwards + 2 * grad_accum_steps * cfg.n_moe_layers
    P = ep_degree
    out = [_row("all_to_all", "expert dispatch and return" + (" (dropless, uneven pieces)" if cfg.moe_dispatch ==
                "dropless" else ""), count, count * rows * cfg.d_model * a, P)]
    if cfg.moe_dispatch == "dropless":
        out.append(_row("all_to_all", "tokens per expert (dropless split sizes)", forwards,
                        forwards * 8 * cfg.n_routed_experts, P))
    return out


def _row(op: str, what: str, count: int, message_bytes: float, ranks: int) -> dict:
    # the ring all-to-all's bytes on the wire: (P-1)/P of the message leaves the rank (comm.wire_bytes)
    return {"group": "dp", "op": op, "what": what, "count": count, "message_bytes": int(message_bytes),
            "wire_bytes": int((ranks - 1) / ranks * message_bytes), "ranks": ranks}


def activation_extra_bytes(cfg: ModelConfig, tokens: int, ep_degree: int, compiled: bool,
                           imbalance: float = EXPERT_IMBALANCE) -> float:
    """Bytes one MoE layer keeps for the backward on the busiest rank beyond what the layer keeps without
    expert parallelism (:func:`scaletool.analytic.timeline._activation_bytes_per_token_per_layer` counts k
    routed rows per token): dropless, the (ρ - 1)·k·tokens extra rows received, each with its grouped GEMM
    input (d) and SwiGLU tensors (4 of i eager, 2 compiled), in the compute dtype. Capacity: none (the
    E·C slots are the same with and without)."""
    if ep_degree == 1 or cfg.moe_dispatch == "capacity":
        return 0.0
    a = cfg.dtype_bytes
    kept = 2 if compiled else 4
    extra_rows = rows_received(cfg, tokens, ep_degree, imbalance) - tokens * routed_experts_computed(cfg)
    return max(0.0, extra_rows) * a * (cfg.d_model + kept * cfg.moe_intermediate_size)


def transient_bytes(cfg: ModelConfig, tokens: int, ep_degree: int, imbalance: float = EXPERT_IMBALANCE) -> float:
    """The all-to-alls' buffers alive inside one MoE layer's forward (or its backward) on the busiest rank:
    the received rows and their regrouped copy (2·ρ·k·tokens·d) and the outputs sent back and returned
    (ρ·k·tokens·d + k·tokens·d), compute dtype. Capacity: the received buffer and the returned one (2·E·C·d)."""
    if ep_degree == 1:
        return 0.0
    a, d = cfg.dtype_bytes, cfg.d_model
    if cfg.moe_dispatch == "capacity":
        return 2.0 * cfg.n_routed_experts * expert_capacity(cfg, tokens) * d * a
    recv = rows_received(cfg, tokens, ep_degree, imbalance)
    return (3 * recv + tokens * cfg.num_experts_per_tok) * d * a


def replicated_state_bytes(cfg: ModelConfig, data_parallel: int, ep_degree: int, bytes_per_param: int = 16) -> float:
    """Model-state bytes per rank beyond 1/D of the routed experts when groups of P < D ranks shard them
    (each rank keeps 1/P, replicated across the D/P groups): fp32 weights, gradients and AdamW's m, v (16 B)."""
    if ep_degree in (1, data_parallel) or not cfg.n_moe_layers:
        return 0.0
    routed = moe_params(cfg)["routed"] * cfg.n_moe_layers
    return bytes_per_param * routed * (1 / ep_degree - 1 / data_parallel)


def step_terms(cfg: ModelConfig, tokens: int, grad_accum_steps: int, ep_degree: int, recompute_fraction: float,
               gemm_rate, imbalance: float = EXPERT_IMBALANCE, host_sync_s: float = HOST_SYNC_S) -> dict:
    """Seconds per optimizer step expert parallelism adds on the critical path besides its all-to-alls
    (which :func:`all_to_all_rows` lists and the step model exposes in full: the experts wait for the
    dispatch, the next block for the return):

    - ``ep/imbalance_s``: the busiest rank's extra expert GEMMs, (ρ - 1) × the routed experts' forward and
      backward (and recomputed forward) at the calibrated rate ``gemm_rate(m, n, k)``; dropless only.
    - ``ep/host_sync_s``: the dropless split sizes' host read, once per MoE layer and forward.
    """
    if ep_degree == 1 or not cfg.n_moe_layers:
        return {"ep/imbalance_s": 0.0, "ep/host_sync_s": 0.0}
    if cfg.moe_dispatch == "capacity":
        return {"ep/imbalance_s": 0.0, "ep/host_sync_s": 0.0}
    E, i, d, L = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.d_model, cfg.n_moe_layers
    m = max(1, round(ep_degree * tokens * cfg.num_experts_per_tok / E))  # rows per local expert at the mean load
    forward = 3 * E * L * 2 * m * i * d / gemm_rate(m, i, d) / ep_degree  # the rank's E/P experts
    passes = 3 + recompute_fraction  # forward, backward (2x), recomputed forward
    imbalance_s = grad_accum_steps * (imbalance - 1) * forward * passes
    syncs = grad_accum_steps * L * (1 + recompute_fraction)
    return {"ep/imbalance_s": imbalance_s, "ep/host_sync_s": syncs * host_sync_s}


def expert_gemm_shape_s(cfg: ModelConfig, tokens: int, grad_accum_steps: int, ep_degree: int, recompute_fraction: float,
                        gemm_rate) -> float:
    """Seconds per optimizer step the routed experts' GEMMs change by under expert parallelism (negative: saved):
    the step model's compute term (:func:`scaletool.analytic.step.gemm_shapes`) runs every one of the E experts on
    one rank's rows, k·tokens/E each, at the rate of that small shape; a rank of a group of P runs E/P experts on
    the rows of all P ranks, P·k·tokens/E each: the same FLOPs as larger GEMMs, at the calibrated rate
    ``gemm_rate(m, n, k)`` of the larger shape (GShard §3.2: what expert parallelism is for beyond memory)."""
    if ep_degree == 1 or not cfg.n_moe_layers:
        return 0.0
    E, i, d, L = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.d_model, cfg.n_moe_layers
    rows = tokens * routed_experts_computed(cfg, tokens) / E
    one, grouped = max(1, round(rows)), max(1, round(ep_degree * rows))
    flops = 3 * L * 2 * E * one * i * d  # the compute term's forward FLOPs of the routed experts
    forward = flops / gemm_rate(grouped, i, d) - flops / gemm_rate(one, i, d)
    return grad_accum_steps * forward * (3 + recompute_fraction)


def predicted_terms(recipe, data_parallel: int, tokens: int, recompute_fraction: float, calib) -> tuple[dict, list[str]]:
    """The step model's hook (:func:`scaletool.analytic.step.predict_step`): :func:`step_terms` of the recipe's
    layout at the calibration's GEMM rate, and the assumption lines; nothing without expert parallelism."""
    p, cfg = recipe.parallel, recipe.model
    P = degree(p.expert_parallel, p.expert_parallel_degree, data_parallel) if engine_kind(p.engine).distributed else 1
    if P == 1 or not cfg.n_moe_layers:
        return {}, []
    gas = recipe.train.grad_accum_steps
    terms = step_terms(cfg, tokens, gas, P, recompute_fraction, calib.gemm_rate)
    terms["ep/expert_gemm_shape_s"] = expert_gemm_shape_s(cfg, tokens, gas, P, recompute_fraction, calib.gemm_rate)
    what = (f"expert parallelism over {P} ranks ({cfg.n_routed_experts // P} experts each): all-to-alls exposed "
            "in full (the experts wait for the dispatch, the next block for the return); the routed experts' GEMMs "
            "at the grouped shape (every group rank's rows per local expert)")
    if cfg.moe_dispatch == "dropless":
        what += (f"; the busiest rank receives {EXPERT_IMBALANCE:g}x the mean routed rows (measured expert imbalance) "
                 f"and the others wait for it; {HOST_SYNC_S * 1e6:.0f} us of host sync per MoE layer and forward "
                 "(split sizes read on the host; assumed)")
    return terms, [what]
