"""Pipeline stages: which layers go where, each stage's memory under its schedule, and the step time.

Torch-free and IO-free, like the rest of :mod:`scaletool.analytic`. With p pipeline ranks, v chunks
(virtual stages) per rank and m pipeline micro-batches of B/m sequences each (``train.micro_batch_size`` B):

- **Split** (:func:`stage_split`): the p·v chunks are contiguous runs of blocks, the first chunk also
  holding the embedding and the last the final norm, the output layer and the loss. The split minimises
  the largest chunk's work (forward FLOPs per token: the blocks' matmuls and attention scores, the
  output layer's 2·d·V), then the largest chunk's memory (16 B per parameter of FSDP2's fp32 states plus the
  saved activations of the micro-batches in flight), by dynamic programming over the cut points. A
  MoE model's dense first layers and a large vocabulary move the cuts (an equal split by layer count does not).
- **Memory per stage** (:func:`stage_memory`): FSDP2's sharded states of the stage's parameters over the
  data-parallel ranks, the gathered 16-bit blocks, and the saved activations of the micro-batches the
  schedule keeps in flight on that rank (:func:`in_flight`, sources in :mod:`scaletool.kinds.pipeline`),
  the first stage's embedding output and the last stage's logits and loss.
- **Step time**: :mod:`scaletool.analytic.pipeline_time`.
"""
from __future__ import annotations

from functools import lru_cache

from scaletool.analytic import expert_parallel as ep_analytic
from scaletool.analytic.comm import tensor_parallel_config
from scaletool.analytic.flops import attention_flops_per_token
from scaletool.analytic.memory import memory_inputs, recipe_memory
from scaletool.analytic.params import attention_params, ffn_params, moe_params, param_counts
from scaletool.analytic.timeline import _activation_bytes_per_token_per_layer
from scaletool.config import ModelConfig, Recipe
from scaletool.kinds.attention import matmul_params as matmul_params_of
from scaletool.kinds.engines import engine_kind
from scaletool.kinds.pipeline import chunk_ranks, pipeline_microbatches, schedule_kind

OPTIMIZER_BYTES_PER_PARAM = 40  # as analytic.step: fused AdamW + clipping, per fp32 parameter on the rank
STATE_BYTES_PER_PARAM = 16  # FSDP2: fp32 parameter, gradient, AdamW m and v


def _is_moe(cfg: ModelConfig, i: int) -> bool:
    return cfg.ffn == "moe" and i >= cfg.first_k_dense_replace


def routed_params(cfg: ModelConfig, i: int) -> int:
    """Routed-expert parameters of block ``i`` (0 for a dense block): what expert parallelism splits."""
    return moe_params(cfg)["routed"] if _is_moe(cfg, i) else 0


def expert_degree(recipe: Recipe, world_size: int | None = None) -> int:
    """Ranks each MoE layer's routed experts are split over within a stage: ``parallel.expert_parallel_degree``
    of the stage's data-parallel ranks (0: all of them) with expert parallelism on, else 1 (FSDP2 shards them)."""
    p = recipe.parallel
    dp = max(1, (world_size or p.world_size) // (p.pipeline_parallel * p.tensor_parallel))
    return ep_analytic.degree(p.expert_parallel and recipe.model.ffn == "moe", p.expert_parallel_degree, dp)


def _state_bytes(cfg: ModelConfig, i: int, dp: int, ep: int) -> float:
    """FSDP2's fp32 states of block ``i`` on one rank: the block over the ``dp`` data-parallel ranks, its routed
    experts over the ``ep`` expert-parallel ranks instead when ``ep`` > 1 (replicated across the dp/ep groups)."""
    routed = routed_params(cfg, i) if ep > 1 else 0
    return STATE_BYTES_PER_PARAM * ((layer_params(cfg, i) - routed) / dp + routed / ep)


def layer_params(cfg: ModelConfig, i: int) -> int:
    """Parameters of block ``i`` (a MoE block past ``first_k_dense_replace`` holds every expert)."""
    dense, moe = _block_params(cfg.model_dump_json())
    return moe if _is_moe(cfg, i) else dense


@lru_cache(maxsize=256)
def _block_params(key: str) -> tuple[int, int]:
    """(a dense block's, a MoE block's) parameters of the model whose JSON is ``key`` (plan asks many times)."""
    cfg = ModelConfig.model_validate_json(key)
    per = param_counts(cfg)["per_layer"]
    moe = sum(moe_params(cfg)[k] for k in ("gate", "routed", "shared")) if cfg.ffn == "moe" else 0
    return per["attention"] + per["norms"] + ffn_params(cfg), per["attention"] + per["norms"] + moe


def layer_flops(cfg: ModelConfig, i: int, seq_len: int) -> float:
    """Forward FLOPs per token of block ``i``: 2 × its active matmul weights plus the causal attention scores."""
    attn = matmul_params_of(attention_params(cfg))
    if _is_moe(cfg, i):
        moe = moe_params(cfg)
        ffn = moe["gate"] + moe["shared"] + moe["routed_active"]
    else:
        ffn = ffn_params(cfg)
    return 2 * (attn + ffn) + attention_flops_per_token(cfg, seq_len, causal=True) / cfg.n_layers


def layer_activation_bytes(cfg: ModelConfig, i: int, activation_checkpointing: str = "none",
                           selective_every: int = 2, compiled: bool = False) -> float:
    """Bytes block ``i`` saves per token for its backward: autograd's count with the 16-bit residual stream of
    FSDP2's mixed precision (:func:`~scaletool.analytic.timeline._activation_bytes_per_token_per_layer`), eager or
    ``compiled`` (each block compiled alone over 16-bit weights keeps what a compiled model's block keeps); a
    checkpointed block keeps only its input."""
    res = 2 if cfg.dtype != "fp32" else 4
    if activation_checkpointing == "full" or (activation_checkpointing == "selective" and (i + 1) % selective_every == 0):
        return res * cfg.d_model
    return _activation_bytes_per_token_per_layer(cfg, moe=_is_moe(cfg, i), res=res, compiled=compiled)


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of the rank's whole
    stage (all of its v chunks); sources in :mod:`scaletool.kinds.pipeline`."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - rank, m))
    if schedule == "zbv":
        return float(min(p, m))
    # interleaved 1F1B and interleaved zero bubble: Megatron-LM's warm-up chunks plus one, at most all m·v
    chunks = min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)
    return chunks / v


def interleaved_peak(p: int, v: int, m: int, rank: int, chunk_bytes: list[float]) -> tuple[float, int]:
    """The largest activations ``rank`` holds under torch's ScheduleInterleaved1F1B and the chunk micro-batches
    then in flight, its local chunks' forwards and backwards in that schedule's order (rounds of R = m / max(1, m // p);
    (v - 1)·R + 2·(p - 1 - rank) warm-up forwards, then a forward and a backward each, the backwards through the
    chunks in reverse); ``chunk_bytes[c]``: one micro-batch of local chunk c."""
    rounds = max(1, m // p)
    R, n = m // rounds, m * v
    warmup = min((v - 1) * R + 2 * (p - 1 - rank), n)
    live, count, best, done = 0.0, 0, (0.0, 0), 0
    for j in range(n):  # backward j follows forward warmup + j (none past the last)
        while done <= min(warmup + j, n - 1):
            live, count, done = live + chunk_bytes[(done // R) % v], count + 1, done + 1
        best = max(best, (live, count))
        live, count = live - chunk_bytes[v - 1 - (j // R) % v], count - 1
    return best


def _chunk_costs(cfg: ModelConfig, seq_len: int, S: int, tokens: int, act: str, every: int,
                 flight: list[float], dp: int, ep: int = 1):
    """Per block (time, memory) and the extras of the first and last chunk, for :func:`stage_split`."""
    L, V, d = cfg.n_layers, cfg.vocab_size, cfg.d_model
    t = [layer_flops(cfg, i, seq_len) for i in range(L)]
    mem_state = [_state_bytes(cfg, i, dp, ep) for i in range(L)]
    mem_act = [layer_activation_bytes(cfg, i, act, every) * tokens for i in range(L)]
    pc = param_counts(cfg)
    first = (0.0, STATE_BYTES_PER_PARAM * (pc["embedding"] + pc["position_embedding"]) / dp)
    last = (2.0 * d * V, STATE_BYTES_PER_PARAM * (pc["head"] + pc["final_norm"]) / dp + 10.0 * tokens * V)
    return t, mem_state, mem_act, first, last


_SPLITS: dict[tuple, tuple[tuple[int, int], ...]] = {}  # memo: plan asks for the same split many times


def _split(cfg: ModelConfig, seq_len: int, S: int, tokens: int, act: str, every: int, flight: tuple[float, ...],
           dp: int, ep: int = 1) -> tuple[tuple[int, int], ...]:
    key = (cfg.model_dump_json(), seq_len, S, tokens, act, every, flight, dp, ep)
    if key not in _SPLITS:
        _SPLITS[key] = _solve(cfg, seq_len, S, tokens, act, every, flight, dp, ep)
    return _SPLITS[key]


def _solve(cfg: ModelConfig, seq_len: int, S: int, tokens: int, act: str, every: int, flight: tuple[float, ...],
           dp: int, ep: int = 1) -> tuple[tuple[int, int], ...]:
    """The bottleneck partition by dynamic programming over the cut points, the lexicographically smallest (time,
    memory) of the largest chunk, the first cut on ties; each chunk's candidate cuts are compared at once
    (numpy), so a 1,024-GPU plan that asks for hundreds of splits answers in seconds."""
    import numpy as np

    L = cfg.n_layers
    t, ms, ma, first, last = _chunk_costs(cfg, seq_len, S, tokens, act, every, list(flight), dp, ep)
    pt, ps, pa = [0.0], [0.0], [0.0]
    for i in range(L):
        pt.append(pt[-1] + t[i])
        ps.append(ps[-1] + ms[i])
        pa.append(pa[-1] + ma[i])
    pt, ps, pa = np.array(pt), np.array(ps), np.array(pa)

    def cost(c: int, i, j: int):
        """(time, memory) of chunk c holding blocks [i, j); i an index or an array of them."""
        time = pt[j] - pt[i] + (first[0] if c == 0 else 0.0) + (last[0] if c == S - 1 else 0.0)
        mem = ps[j] - ps[i] + flight[c] * (pa[j] - pa[i]) + (first[1] if c == 0 else 0.0) + (last[1] if c == S - 1 else 0.0)
        return time, mem

    # bt[c][j], bm[c][j]: the best bottleneck (time, memory) of chunks 0..c covering blocks [0, j); chunk c's
    # candidates for every j at once: cut i (rows) and end j (columns), valid where c <= i < j
    bt, bm = np.full((S, L + 1), np.inf), np.full((S, L + 1), np.inf)
    cut = np.zeros((S, L + 1), dtype=np.int64)
    for j in range(1, L - S + 2):
        bt[0, j], bm[0, j] = cost(0, 0, j)
    rows, cols = np.arange(L + 1)[:, None], np.arange(L + 1)[None, :]
    for c in range(1, S):
        ct, cm = cost(c, rows[c:], cols)
        prev_t, prev_m = bt[c - 1, c:, None], bm[c - 1, c:, None]
        keep = (prev_t > ct) | ((prev_t == ct) & (prev_m >= cm))  # the larger of the two, as max() takes it
        ht, hm = np.where(keep, prev_t, ct), np.where(keep, prev_m, cm)
        valid = rows[c:] < cols
        low = valid & (ht == np.where(valid, ht, np.inf).min(axis=0))
        pick = low & (hm == np.where(low, hm, np.inf).min(axis=0))  # then the least memory, the first cut
        at = pick.argmax(axis=0)
        span = np.arange(c + 1, L - (S - 1 - c) + 1)
        bt[c, span], bm[c, span], cut[c, span] = ht[at[span], span], hm[at[span], span], c + at[span]
    bounds, j = [], L
    for c in range(S - 1, -1, -1):
        i = int(cut[c, j]) if c else 0
        bounds.append((i, j))
        j = i
    return tuple(reversed(bounds))


def stage_split(recipe: Recipe, world_size: int | None = None) -> list[tuple[int, int]]:
    """Block ranges ``[start, end)`` of the p·v chunks in model order (chunk c runs on rank
    :func:`~scaletool.kinds.pipeline.chunk_ranks`\\ [c]); the first chunk also holds the embedding, the last
    the final norm, output layer and loss. What ``train`` builds and ``estimate`` prints."""
    p = recipe.parallel
    P, v = p.pipeline_parallel, p.pipeline_virtual_stages
    S = P * v
    m = pipeline_microbatches(recipe)
    tokens = recipe.train.micro_batch_size // m * recipe.seq_len
    ranks = chunk_ranks(p.pipeline_schedule, P, v)
    flight = tuple(in_flight(p.pipeline_schedule, P, v, m, ranks[c]) for c in range(S))
    # a rank's states: its blocks' over the stage's data-parallel ranks and, split by tensor parallelism, over the
    # tensor-parallel ranks too; so the split is the same for every TP degree (plan reuses it)
    dp = max(1, (world_size or p.world_size) // P)
    t = recipe.train
    return list(_split(recipe.model, recipe.seq_len, S, tokens, t.activation_checkpointing, t.selective_every,
                       flight, dp, expert_degree(recipe, world_size)))


def rank_layers(recipe: Recipe, split: list[tuple[int, int]]) -> list[list[int]]:
    """The blocks each pipeline rank holds, in model order."""
    p = recipe.parallel
    ranks = chunk_ranks(p.pipeline_schedule, p.pipeline_parallel, p.pipeline_virtual_stages)
    out: list[list[int]] = [[] for _ in range(p.pipeline_parallel)]
    for c, (i, j) in enumerate(split):
        out[ranks[c]].extend(range(i, j))
    return [sorted(x) for x in out]


def bubble_fraction(schedule: str, p: int, v: int, m: int) -> float:
    """Share of a balanced pipeline's step that ranks sit idle: idle slots (p - 1)/v · w over the step's
    m + (p - 1)/v · w (w the schedule's idle share of a slot: 1 for GPipe and 1F1B, Narayanan et al.
    2021's (p - 1)/(v·m) of the ideal time for interleaving; less for the zero-bubble schedules)."""
    idle = (p - 1) / v * schedule_kind(schedule).bubble_work
    return idle / (m + idle) if p > 1 else 0.0


def _stage_cfg(cfg: ModelConfig, layers: list[int]) -> ModelConfig:
    """The model a rank's blocks form (their count; a MoE model's dense blocks among them first)."""
    dense = sum(1 for i in layers if not _is_moe(cfg, i))
    update = {"n_layers": max(1, len(layers))}
    if cfg.ffn == "moe":
        update["first_k_dense_replace"] = dense
    return cfg.model_copy(update=update)


def peak_bytes(recipe: Recipe, world_size: int) -> float:
    """The recipe's estimated peak per GPU: its largest pipeline stage's under pipeline stages
    (:func:`stage_memory`), else :func:`scaletool.analytic.memory.recipe_memory`'s: the one figure ``estimate``,
    ``plan`` and ``train``'s memory check give for a layout."""
    if recipe.parallel.pipeline_parallel > 1:
        return max(row["total_bytes"] for row in stage_memory(recipe, world_size))
    ranks = world_size if engine_kind(recipe.parallel.engine).distributed else 1
    return recipe_memory(recipe, ranks)["total_bytes"]


def _micro_batch_bytes(cfg: ModelConfig, acts: dict, blocks, holds_head: bool, tokens: int, tp: int) -> float:
    """One micro-batch's saved activations of these blocks (``acts``: bytes per token of each); sequence parallelism
    shards each block's norm inputs (a checkpointed block's one input) and the final norm's."""
    a = 2 if cfg.dtype != "fp32" else 4
    out = tokens * sum(acts[i] for i in blocks)
    if tp > 1:
        kept = sum(1 if acts[i] <= a * cfg.d_model else 2 for i in blocks) + (1 if holds_head else 0)
        out -= tokens * a * cfg.d_model * kept * (1 - 1 / tp)
    return out


def stage_memory(recipe: Recipe, world_size: int, split: list[tuple[int, int]] | None = None) -> list[dict]:
    """Peak bytes of each pipeline rank (FSDP2 over ``world_size / p`` data-parallel ranks): its states,
    gathered blocks, the activations of its micro-batches in flight, and the first and last stages' extras.
    With expert parallelism (:func:`expert_degree` > 1) a MoE block's routed experts stay out of FSDP2: their
    states split over the expert-parallel ranks, their 16-bit copy made per layer, and the busiest rank's extra
    routed rows and all-to-all buffers (:mod:`scaletool.analytic.expert_parallel`) added."""
    t, p = recipe.train, recipe.parallel
    P, v, tp = p.pipeline_parallel, p.pipeline_virtual_stages, p.tensor_parallel
    # tensor parallelism within each stage: what one rank of its group holds (heads, FFN width and vocabulary
    # split; analytic.comm.tensor_parallel_config), the residual stream sequence-sharded between the sub-layers
    cfg = tensor_parallel_config(recipe.model, tp)
    split = split or stage_split(recipe, world_size)
    m = pipeline_microbatches(recipe)
    dp = max(1, world_size // (P * tp))
    ep = expert_degree(recipe, world_size)
    tokens = t.micro_batch_size // m * recipe.seq_len
    pc = param_counts(cfg)
    a = 2 if cfg.dtype != "fp32" else 4
    # train.compile compiles each block of a stage alone (scaletool.engines.pipeline), over FSDP2's 16-bit weights
    compiled = memory_inputs(recipe).compiled
    rows = []
    owners = chunk_ranks(p.pipeline_schedule, P, v)
    for r, layers in enumerate(rank_layers(recipe, split)):
        first, last = owners[0] == r, owners[-1] == r
        ends = (pc["embedding"] + pc["position_embedding"] if first else 0) + (pc["head"] + pc["final_norm"] if last else 0)
        params = sum(layer_params(cfg, i) for i in layers) + ends
        states = sum(_state_bytes(cfg, i, dp, ep) for i in layers) + STATE_BYTES_PER_PARAM * ends / dp
        # what FSDP2 gathers of a block (its routed experts are local under expert parallelism)
        sharded = [layer_params(cfg, i) - (routed_params(cfg, i) if ep > 1 else 0) for i in layers]
        # the 16-bit copies FSDP2 gathers: every block of the stage, whatever reshard_after_forward says, since
        # torch's schedule turns resharding after the backward off for all but the last micro-batch
        # (set_reshard_after_backward(False)): a block gathered for a backward stays so until its next forward,
        # and by the end of a backward every block of the chunk is gathered; the chunk's own parameters
        # (embedding, final norm, head) are a root unit never resharded after the forward
        # (scaletool.engines.pipeline). Expert parallelism casts one layer's local experts to 16 bits as it runs them
        gathered = a * (sum(sharded) + ends)
        moe_here = sum(1 for i in layers if _is_moe(cfg, i))
        if ep > 1 and moe_here:
            gathered += a * moe_params(cfg)["routed"] / ep
        flight = in_flight(p.pipeline_schedule, P, v, m, r)
        acts = {i: layer_activation_bytes(cfg, i, t.activation_checkpointing, t.selective_every, compiled)
                for i in layers}
        embed_mb = a * tokens * cfg.d_model / tp if first else 0.0  # the embedding's output, kept per micro-batch
        live_mb = flight * (_micro_batch_bytes(cfg, acts, layers, last, tokens, tp) + embed_mb)
        if schedule_kind(p.pipeline_schedule).issue_order:  # which chunks are in flight, in torch's order
            chunk = [_micro_batch_bytes(cfg, acts, range(*split[c]), c == len(split) - 1, tokens, tp)
                     + (embed_mb if c == 0 else 0.0) for c in range(len(split)) if owners[c] == r]
            live_mb, count = interleaved_peak(P, v, m, r, chunk)
            flight = count / v
        recompute = 0.0
        if t.activation_checkpointing != "none" and layers:  # one block's saved tensors live again in its backward
            recompute = tokens * max(_activation_bytes_per_token_per_layer(cfg, moe=_is_moe(cfg, i), res=a,
                                                                           compiled=compiled) for i in layers)
        ep_bytes = 0.0
        if ep > 1 and moe_here:  # the busiest rank's extra routed rows per MoE layer kept, its all-to-all buffers
            saved = [i for i in layers if _is_moe(cfg, i) and layer_activation_bytes(
                cfg, i, t.activation_checkpointing, t.selective_every) > a * cfg.d_model]
            ep_bytes = (flight * len(saved) * ep_analytic.activation_extra_bytes(cfg, tokens, ep, t.compile)
                        + ep_analytic.transient_bytes(cfg, tokens, ep))
        # at the loss's backward: the 16-bit logits (the stage's output, which torch's schedule keeps for the
        # backward), log_softmax's saved fp32 output, and NLL's and log_softmax's fp32 gradients: one micro-batch
        # at a time under 1F1B (the last stage runs each micro-batch's backward right after its forward); GPipe
        # keeps m micro-batches' logits and saved outputs
        kept = (a + 4) * (m if p.pipeline_schedule == "gpipe" else 1)
        logits = (kept + 8) * tokens * cfg.vocab_size if last else 0.0
        # receive and send buffers, activations and gradients, per chunk (this rank's sequence shard under TP)
        p2p = 4 * a * tokens * cfg.d_model * v / tp
        activations = live_mb + recompute + logits + ep_bytes
        total = states + gathered + activations + p2p
        rows.append({"rank": r, "layers": layers, "params": params, "first": first, "last": last,
                     "in_flight_micro_batches": flight, "expert_parallel": ep, "states_bytes": int(states),
                     "gathered_bytes": int(gathered), "activations_bytes": int(activations),
                     "expert_parallel_bytes": int(ep_bytes), "p2p_buffers_bytes": int(p2p), "total_bytes": int(total)})
    return rows
