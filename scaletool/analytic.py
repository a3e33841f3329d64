"""The analytic model: closed forms, config in, numbers out. No model is instantiated here.

Conventions, stated once:
- FLOPs are floating-point operations, a multiply-add counts as 2.
- "causal" attention FLOPs count the T²/2 scores a causal mask leaves (PaLM, Chowdhery et al. 2022,
  appendix B); "full" counts all T² (what FlopCounterMode and fvcore measure, since SDPA computes
  the masked tiles' cost away only inside fused kernels).
- Matmul parameters are the weights of every Linear layer, the LM head included (tied or not); the
  token-embedding and learned-position lookups are gathers, no matmul; norms, biases, position
  tables added to the embeddings and ALiBi's score bias are element-wise (not counted).
- Each attention kind's own closed forms (parameters by projection, cache per token, decode FLOPs)
  live with the kind, ``scaletool.attention_kinds``; this module sums them over the model.
- Mixture of experts (ffn=moe): "active" parameters are those one token multiplies (dense parts,
  router, shared experts, its top-k routed experts); ``matmul_params`` and the FLOPs count those.
  The capacity-based dispatch computes every expert's full capacity buffer, so FLOPs *computed*
  (what a FLOP counter sees, the ``*_computed`` keys) count E·C/N ≈ capacity_factor·k routed experts
  per token, while *useful* FLOPs (the MFU convention, the plain keys) count k.
"""
from __future__ import annotations

from dataclasses import dataclass

from scaletool.attention_kinds import attention_kind, position_kind
from scaletool.attention_kinds import matmul_params as matmul_params_of
from scaletool.config import ModelConfig, Recipe, expert_capacity

# ---------------------------------------------------------------------------------------------
# Parameters


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    return dim if cfg.norm == "rmsnorm" else 2 * dim


def attention_params(cfg: ModelConfig) -> dict[str, int]:
    """Per-layer attention parameters by projection, named as the module's attributes (the kind's
    closed form, ``scaletool.attention_kinds``).

    MHA/GQA/MQA (Llama layout): wq d·H·hd, wk and wv d·KV·hd each, wo H·hd·d (+ (H+2·KV)·hd
    biases with ``qkv_bias``, as Qwen2).
    MLA (DeepSeek-V2 §2.1, V3 inference code): wq d·H·(nope+rope) or wq_a d·q_lora + q_norm q_lora +
    wq_b q_lora·H·(nope+rope); wkv_a d·(kv_lora+rope); kv_norm kv_lora; wkv_b kv_lora·H·(nope+v);
    wo H·v·d. With ``mla_rope=per_head`` wkv_a is d·kv_lora and wkv_b kv_lora·H·(nope+rope+v).
    """
    return attention_kind(cfg).params(cfg)


def ffn_params(cfg: ModelConfig) -> int:
    """Dense FFN per layer. SwiGLU: 3·d·i (gate, up, down); GELU/ReLU: 2·d·i. No biases.

    ffn=moe: the dense SwiGLU of the first ``first_k_dense_replace`` layers."""
    mats = 3 if cfg.ffn in ("swiglu", "moe") else 2
    return mats * cfg.d_model * cfg.intermediate_size


def moe_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE layer (DeepSeekMoE): router d·E (no bias), routed experts E·3·d·i_moe, shared experts
    one SwiGLU of n_shared·i_moe, i.e. n_shared·3·d·i_moe; a token uses k routed experts, k·3·d·i_moe.

    V3's selection bias (E per layer) is a buffer, not a parameter, and is not counted here (HF's
    checkpoint stores it as ``e_score_correction_bias``: 14,848 more numbers for V3).
    """
    expert = 3 * cfg.d_model * cfg.moe_intermediate_size
    E = cfg.n_routed_experts
    return {"gate": cfg.d_model * E, "routed": E * expert, "shared": cfg.n_shared_experts * expert,
            "routed_active": cfg.num_experts_per_tok * expert, "per_expert": expert}


def param_counts(cfg: ModelConfig) -> dict:
    """Exact parameter count by component; equals ``sum(p.numel())`` of the built model."""
    d, L = cfg.d_model, cfg.n_layers
    attn = attention_params(cfg)
    attn_layer = sum(attn.values())
    n_moe = cfg.n_moe_layers
    moe = moe_params(cfg) if n_moe else None
    moe_layer = moe["gate"] + moe["routed"] + moe["shared"] if moe else 0
    ffn_total = (L - n_moe) * ffn_params(cfg) + n_moe * moe_layer
    # the largest block's FFN: what FSDP / ZeRO-3 gather at once
    ffn_layer = moe_layer if n_moe else ffn_params(cfg)
    norms_layer = 2 * _norm_params(cfg, d)
    positions = position_kind(cfg).params(cfg)  # a learned table; the others have no parameters
    if cfg.task == "lm":
        embedding = cfg.vocab_size * d
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    else:  # grouped feature Linear layers (with bias) + BatchNorm1d weight and bias
        embedding = sum(s * w + w for s, w in zip(cfg.feature_groups, cfg.group_widths)) + 2 * d
        head = d * cfg.horizon + cfg.horizon
    final_norm = _norm_params(cfg, d) if cfg.norm_placement == "pre" else 0  # post-norm blocks end normalised
    layers = L * (attn_layer + norms_layer) + ffn_total
    total = embedding + positions + layers + final_norm + head
    # "Non-embedding" (Kaplan et al. 2020) leaves out the vocabulary matrices (the input embedding
    # and an untied LM head) and positional embeddings. The regression model's feature embedding and
    # head are kept: they are small.
    non_embedding = total - positions - (embedding + head if cfg.task == "lm" else 0)
    rule = 12 * d * d * L
    inactive = n_moe * (moe["routed"] - moe["routed_active"]) if moe else 0
    out = {
        "total": total,
        "active": total - inactive,
        "non_embedding": non_embedding,
        "embedding": embedding,
        "position_embedding": positions,
        "head": head,
        "final_norm": final_norm,
        "attention": L * attn_layer,
        "ffn": ffn_total,
        "norms": L * norms_layer + final_norm,
        "per_layer": {"attention": attn_layer, "ffn": ffn_layer, "norms": norms_layer,
                      "attention_by_projection": attn},
        "matmul": matmul_params(cfg),
        "rule_of_thumb_12d2L": rule,
        # The rule ignores embeddings, so it is compared with the non-embedding count.
        "rule_of_thumb_rel_error": (rule - non_embedding) / non_embedding,
    }
    if moe:
        out["moe"] = {"layers": n_moe, "dense_layers": L - n_moe, "per_layer": moe,
                      "routed_total": n_moe * moe["routed"], "routed_active": n_moe * moe["routed_active"],
                      "active_fraction": out["active"] / total,
                      # DeepSeek's "activated parameters" leave out the token embedding (a lookup)
                      "active_excl_embedding": out["active"] - embedding}
    return out


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every Linear, the LM head included; for MoE
    only the active experts (``matmul_split``)."""
    split = matmul_split(cfg)
    return split["dense"] + split["routed_active"]


def matmul_split(cfg: ModelConfig) -> dict[str, int]:
    """Matmul weights per token split into ``dense`` (attention, dense FFNs, router, shared experts,
    head) and routed experts: ``routed_active`` (k per MoE layer) of ``routed_total`` (E per layer)."""
    attn_mm = matmul_params_of(attention_params(cfg))
    n_moe = cfg.n_moe_layers
    n = cfg.n_layers * attn_mm + (cfg.n_layers - n_moe) * ffn_params(cfg)
    routed = {"routed_active": 0, "routed_total": 0}
    if n_moe:
        moe = moe_params(cfg)
        n += n_moe * (moe["gate"] + moe["shared"])
        routed = {"routed_active": n_moe * moe["routed_active"], "routed_total": n_moe * moe["routed"]}
    if cfg.task == "lm":
        n += cfg.vocab_size * cfg.d_model  # LM head, tied or not: still a (d × vocab) matmul
    else:
        n += sum(s * w for s, w in zip(cfg.feature_groups, cfg.group_widths)) + cfg.d_model * cfg.horizon
    return {"dense": n, **routed}


# ---------------------------------------------------------------------------------------------
# FLOPs


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
    """Forward attention-score FLOPs per token, all layers: QKᵀ (2·H·T·d_qk) plus AV (2·H·T·d_v).

    Full: 2·L·H·T·(d_qk + d_v). Causal halves it (PaLM appendix B counts T/2 keys on average).
    """
    full = 2 * cfg.n_layers * cfg.n_heads * seq_len * (cfg.qk_head_dim + cfg.v_dim)
    return full / 2 if causal else float(full)


def routed_experts_computed(cfg: ModelConfig, tokens: int | None = None) -> float:
    """Routed experts the capacity dispatch computes per token: E·C/N for a dispatch of N = ``tokens``
    tokens (exact, C from :func:`expert_capacity`), or min(capacity_factor·k, E) when N is not given."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if tokens is None:
        return min(cfg.capacity_factor * k, E)
    return E * expert_capacity(cfg, tokens) / tokens


def flops_per_token(cfg: ModelConfig, seq_len: int, tokens: int | None = None) -> dict:
    """Forward and training FLOPs per token (training = 3 × forward: backward is twice forward).

    train = 6·N_matmul + 6·L·H·T·(d_qk + d_v)/2 (causal, the MFU convention used here), with the
    full-attention figure beside it. For the non-causal regression model the two coincide in
    ``train``: it uses the full figure. N_matmul counts active parameters (k routed experts per MoE
    layer); ``*_computed`` adds the capacity padding the dispatch computes (``tokens`` per dispatch,
    see :func:`routed_experts_computed`), equal to the plain keys for dense models.
    """
    n = matmul_params(cfg)
    dense_fwd = 2 * n
    padding_fwd = 0.0
    if cfg.n_moe_layers:
        extra = routed_experts_computed(cfg, tokens) - cfg.num_experts_per_tok
        padding_fwd = 2 * cfg.n_moe_layers * moe_params(cfg)["per_expert"] * extra
    if cfg.task == "regression":  # the head reads only the last time step: once per sequence
        dense_fwd -= 2 * cfg.d_model * cfg.horizon * (1 - 1 / seq_len)
    out = {}
    for conv in ("causal", "full"):
        att = attention_flops_per_token(cfg, seq_len, causal=(conv == "causal"))
        out[f"forward_{conv}"] = dense_fwd + att
        out[f"train_{conv}"] = 3 * (dense_fwd + att)
        out[f"forward_{conv}_computed"] = dense_fwd + padding_fwd + att
        out[f"train_{conv}_computed"] = 3 * (dense_fwd + padding_fwd + att)
        out[f"attention_forward_{conv}"] = att
    native = "causal" if cfg.task == "lm" else "full"
    out["train"] = out[f"train_{native}"]
    out["forward"] = out[f"forward_{native}"]
    out["dense_6N"] = 6 * n
    out["convention"] = native
    if cfg.n_moe_layers:
        out["moe"] = {"routed_experts_per_token_useful": cfg.num_experts_per_tok,
                      "routed_experts_per_token_computed": routed_experts_computed(cfg, tokens),
                      "tokens_per_dispatch": tokens}
    return out


def decode_flops_per_token(cfg: ModelConfig, context: int, mode: str | None = None, batch: int = 1) -> dict:
    """FLOPs of one decoded token: a step of ``batch`` sequences at position ``context`` - 1, attending over
    ``context`` cached positions (the new token's included), divided by the batch.

    Dense part: 2 × the matmul weights outside attention (FFN, router and shared experts, LM head; the MoE
    dispatch of ``batch`` tokens computes its capacity buffers as in :func:`flops_per_token`). Attention:
    the kind's ``decode_flops_per_layer`` in ``mode`` (None: the kind's default) over all layers, which
    for MLA differs by mode: absorbed (W_UK folded into the query, context-length terms over
    kv_lora_rank + rope), expand (wkv_b over every cached latent: grows as context·kv_lora·H·(nope+v)),
    naive (the up-projected cache). The regression model has no decode.
    """
    kind = attention_kind(cfg)
    mode = kind.resolve_mode(cfg, mode)
    fwd = flops_per_token(cfg, 1, tokens=batch)  # one token: its forward without the attention layers
    dense = fwd["forward_full_computed"] - fwd["attention_forward_full"] - 2 * cfg.n_layers * matmul_params_of(
        attention_params(cfg))
    attention = cfg.n_layers * kind.decode_flops_per_layer(cfg, context, mode)
    return {"context": context, "mode": mode, "label": kind.decode_label(cfg, mode), "batch": batch,
            "total": dense + attention, "attention": attention, "dense": dense}


def decode_flops_by_mode(cfg: ModelConfig, context: int) -> dict[str, float]:
    """FLOPs per decoded token at ``context`` for every decode mode of the kind, by the label decode reports
    (mha; mla, mla-expand, mla-naive; mla-per_head, mla-per_head-naive)."""
    kind = attention_kind(cfg)
    return {r["label"]: r["total"] for r in (decode_flops_per_token(cfg, context, m)
                                             for m in kind.decode_modes(cfg) or (None,))}


# ---------------------------------------------------------------------------------------------
# KV cache


def cache_bytes_per_token(cfg: ModelConfig, mode: str | None = None) -> int:
    """KV-cache bytes per token, all layers, at the recipe dtype, in decode ``mode`` (None: the kind's
    default; ``scaletool.attention_kinds.MLA_MODES``)."""
    kind = attention_kind(cfg)
    return kind.cache_layout(cfg, kind.resolve_mode(cfg, mode)).elements * cfg.dtype_bytes * cfg.n_layers


def kv_cache(cfg: ModelConfig) -> dict:
    """KV-cache bytes per token at the recipe dtype (DeepSeek-V2, Table 1), in the default decode mode.

    MHA/GQA/MQA: 2·n_kv_heads·head_dim per layer. MLA caches the normalised latent and the shared
    RoPE key: kv_lora_rank + qk_rope_head_dim per layer (what absorbed decoding reads); with
    ``mla_rope=per_head`` the latent alone, kv_lora_rank (keys re-expanded every step). MLA's naive
    form caches full per-head keys and values: n_heads·(qk_head_dim + v_head_dim) per layer, which is
    also the MHA with the same heads and head dims that the compression ratio is taken against.
    ``by_mode`` gives the bytes per token of every decode mode the kind has.
    """
    kind = attention_kind(cfg)
    b, L, H = cfg.dtype_bytes, cfg.n_layers, cfg.n_heads
    elems = kind.cache_layout(cfg, None).elements
    mha_equiv = H * (cfg.qk_head_dim + cfg.v_dim)
    out = {
        "elements_per_token_per_layer": elems,
        "bytes_per_token_per_layer": elems * b,
        "bytes_per_token": elems * b * L,
        "mha_equivalent_bytes_per_token": mha_equiv * b * L,
        "compression_ratio": mha_equiv / elems,
        "dtype": cfg.dtype,
    }
    modes = kind.decode_modes(cfg)
    if modes:
        out["by_mode"] = {m: cache_bytes_per_token(cfg, m) for m in modes}
    if "naive" in modes:
        out["naive_bytes_per_token"] = out["by_mode"]["naive"]
    return out


# ---------------------------------------------------------------------------------------------
# Training memory


@dataclass(frozen=True)
class MemoryInputs:
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str = "none"  # none | full | selective
    selective_every: int = 2


def _activation_bytes_per_token_per_layer(cfg: ModelConfig, moe: bool = False, res: int = 4) -> float:
    """Bytes autograd keeps per token in one block, eager mode, mixed precision.

    Counted tensor by tensor (residual stream of ``res`` bytes, 16-bit matmul inputs): each norm
    keeps its input (res·d) and the 16-bit cast its matmul reads (2d); fused SDPA keeps q, k, v and the output
    (no T×T scores) plus an fp32 log-sum-exp per head; SwiGLU keeps gate, up, silu(gate) and their
    product (4 tensors of i), GELU/ReLU the pre-activation and activation (2 of i).
    A MoE block (``moe``) keeps the router's fp32 logits and scores (2·E), the dispatch buffer
    (d per computed slot, E·C/N ≈ capacity_factor·k slots per token) and each slot's SwiGLU
    (4·i_moe), the k gathered expert outputs (k·d), and the shared experts' SwiGLU (4·n_shared·i_moe).
    """
    d, H, a = cfg.d_model, cfg.n_heads, 2 if cfg.dtype != "fp32" else 4
    norms = 2 * (res * d + a * d)
    if cfg.attention == "mla":
        c, r, qk, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim, cfg.v_dim
        attn = a * (H * qk + H * qk + H * v + H * v)  # q, k, v, out
        attn += a * (2 * c + r)  # latent split + kv_norm output (wkv_b input)
        if cfg.q_lora_rank:
            attn += a * 2 * cfg.q_lora_rank
    else:
        hd, KV = cfg.head_dim, cfg.n_kv_heads
        attn = a * (2 * H * hd + 2 * KV * hd)  # q, out; k, v
    attn += 4 * H  # log-sum-exp
    if moe:
        slots, i = routed_experts_computed(cfg), cfg.moe_intermediate_size
        ffn = (4 * 2 * cfg.n_routed_experts + a * slots * (d + 4 * i) + a * cfg.num_experts_per_tok * d
               + a * 4 * cfg.n_shared_experts * i)
    else:
        ffn = a * cfg.intermediate_size * (4 if cfg.ffn in ("swiglu", "moe") else 2)
    return norms + attn + ffn


#: DeepSpeed settings the ZeRO-3 estimate depends on, in elements: scaletool's default reduce bucket
#: (``scaletool.engines.deepspeed.DEFAULTS``) and DeepSpeed's default ``stage3_max_reuse_distance``.
ZERO_REDUCE_BUCKET = 500_000_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000


def training_memory(cfg: ModelConfig, engine: str, world_size: int, inputs: MemoryInputs, *,
                    zero_stage: int = 1, reshard_after_forward: bool = True, expert_parallel: bool = False,
                    reduce_bucket: float = ZERO_REDUCE_BUCKET,
                    max_reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE) -> dict:
    """Peak bytes per GPU: weights + gradients + optimizer state + activations (+ transient buffers).

    MoE: model states count every parameter (all experts are trained). With ``expert_parallel``
    (FSDP2) each rank keeps 1/N of the routed experts itself, so the states are still Ψ/N per rank,
    but FSDP's per-block all-gather no longer includes the routed experts.

    Model states follow ZeRO (Rajbhandari et al. 2020, §3): with 16-bit training DeepSpeed keeps
    16-bit params (2Ψ) and grads (2Ψ) plus fp32 master weights, Adam m and v (12Ψ); ZeRO-1 shards
    the 12Ψ, ZeRO-2 also the grads, ZeRO-3 also the params. Torch-native engines (single, DDP,
    FSDP2) keep fp32 params (4Ψ) and grads (4Ψ) and Adam m, v (8Ψ) and cast under autocast or the
    FSDP2 mixed-precision policy; FSDP2 shards all three and all-gathers 16-bit blocks on demand.

    ZeRO-3 adds DeepSpeed's own buffers (measured on 1 and 2 H200s, recipes/benchmarks/train.md):
    the contiguous gradient bucket (``reduce_bucket`` 16-bit elements, allocated for good), and the
    gathered parameters it does not release because they are used again within
    ``max_reuse_distance`` elements of the trace: at the turn from forward to backward, the last
    max_reuse_distance/2 elements of parameters stay gathered (16-bit, at full size).
    """
    psi = param_counts(cfg)["total"]
    N = world_size
    p16 = cfg.dtype_bytes
    mixed = cfg.dtype != "fp32"
    block_params = param_counts(cfg)["per_layer"]
    block_psi = block_params["attention"] + block_params["ffn"] + block_params["norms"]
    if expert_parallel and cfg.n_moe_layers:
        block_psi -= moe_params(cfg)["routed"]
    transient = 0.0
    if engine in ("single", "ddp"):
        weights, grads, optim = 4 * psi, 4 * psi, 8 * psi
    elif engine == "fsdp":
        weights, grads, optim = 4 * psi / N, 4 * psi / N, 8 * psi / N
        # unsharded 16-bit params of the running and the prefetched block, and one block's
        # unsharded gradients before reduce-scatter (16-bit, cast to fp32 for the reduction)
        # (at N = 1 too: the all-gather is then a copy, cast to 16 bits)
        transient = 2 * block_psi * p16 + block_psi * (p16 + 4)
    elif engine == "deepspeed":
        s = zero_stage
        master = 12 if mixed else 8  # fp32 master + m + v; fp32 training needs no separate master
        weights = (p16 if mixed else 4) * psi / (N if s >= 3 else 1)
        grads = (p16 if mixed else 4) * psi / (N if s >= 2 else 1)
        optim = master * psi / (N if s >= 1 else 1)
        if s >= 3:
            transient = (reduce_bucket + min(psi, max_reuse_distance / 2)) * p16
            if N > 1:  # the running and the prefetched block, gathered
                transient += 2 * block_psi * p16
    else:
        raise ValueError(f"unknown engine {engine!r}")

    tokens = inputs.micro_batch_size * inputs.seq_len
    L = cfg.n_layers
    dense_layers = L - cfg.n_moe_layers
    # Residual stream dtype: 16-bit under mixed precision for every engine (the model casts the
    # embedding output to the autocast dtype; FSDP2's policy and DeepSpeed's 16-bit module compute
    # in 16 bits throughout), fp32 otherwise.
    res = p16 if mixed else 4
    layer_bytes = [_activation_bytes_per_token_per_layer(cfg, moe=i >= dense_layers, res=res) for i in range(L)]
    per_layer = sum(layer_bytes) / L
    ac = inputs.activation_checkpointing
    # checkpointed blocks keep only their input; one of them lives again during its recomputation
    ckpt = [ac == "full" or (ac == "selective" and (i + 1) % inputs.selective_every == 0) for i in range(L)]
    kept = sum(res * cfg.d_model if c else b for c, b in zip(ckpt, layer_bytes))
    recompute = max((b for c, b in zip(ckpt, layer_bytes) if c), default=0)
    act_layers = tokens * (kept + recompute)
    if cfg.task == "lm":
        # embedding output, final norm, 16-bit logits, their fp32 copy and log-softmax kept for CE
        a = 2 if mixed else 4
        head_act = tokens * (res * cfg.d_model * 2 + cfg.vocab_size * (a + 4 + 4))
    else:
        head_act = tokens * (res * cfg.d_model * 3)
    activations = act_layers + head_act
    total = weights + grads + optim + transient + activations
    return {
        "engine": engine, "world_size": N, "zero_stage": zero_stage if engine == "deepspeed" else None,
        "weights_bytes": int(weights), "gradients_bytes": int(grads), "optimizer_bytes": int(optim),
        "transient_bytes": int(transient), "activations_bytes": int(activations),
        "activations_per_token_per_layer_bytes": int(per_layer),
        "total_bytes": int(total),
    }


def memory_table(recipe: Recipe, world_size: int | None = None) -> list[dict]:
    """Training memory for single, DDP, FSDP and ZeRO-1/2/3, with and without checkpointing."""
    N = world_size or recipe.parallel.world_size
    t = recipe.train
    rows = []
    for ac in ("none", "full"):
        inp = MemoryInputs(t.micro_batch_size, recipe.seq_len, ac, t.selective_every)
        for engine, stage in [("single", None), ("ddp", None), ("fsdp", None),
                              ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]:
            if engine == "single" and N > 1:
                continue
            row = training_memory(recipe.model, engine, 1 if engine == "single" else N, inp,
                                  zero_stage=stage or 0)
            row["activation_checkpointing"] = ac
            row["label"] = f"zero{stage}" if engine == "deepspeed" else engine
            rows.append(row)
    return rows


def recipe_memory(recipe: Recipe, world_size: int) -> dict:
    """Memory estimate for the engine and settings the recipe itself selects."""
    t, p = recipe.train, recipe.parallel
    inp = MemoryInputs(t.micro_batch_size, recipe.seq_len, t.activation_checkpointing, t.selective_every)
    zero = p.deepspeed.get("zero_optimization") or {}

    def setting(key: str, default: float) -> float:  # a DeepSpeed passthrough number, else its default
        try:
            return float(zero.get(key, default))
        except (TypeError, ValueError):
            return default

    return training_memory(recipe.model, p.engine, world_size, inp, zero_stage=p.zero_stage,
                           reshard_after_forward=p.reshard_after_forward, expert_parallel=p.expert_parallel,
                           reduce_bucket=setting("reduce_bucket_size", ZERO_REDUCE_BUCKET),
                           max_reuse_distance=setting("stage3_max_reuse_distance", ZERO3_MAX_REUSE_DISTANCE))


# ---------------------------------------------------------------------------------------------
# Everything at once


def estimate(recipe: Recipe, *, tokens: int | None = None, world_size: int | None = None) -> dict:
    """The full analytic picture of a recipe as one JSON-ready dict."""
    cfg = recipe.model
    T = recipe.seq_len
    params = param_counts(cfg)
    flops = flops_per_token(cfg, T)
    N = world_size or recipe.parallel.world_size
    train_tokens = tokens if tokens is not None else (
        recipe.train.steps * recipe.train.micro_batch_size * recipe.train.grad_accum_steps * T * N)
    kv = kv_cache(cfg)
    b = cfg.dtype_bytes
    return {
        "model": {"attention": cfg.attention, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                  "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "task": cfg.task},
        "seq_len": T,
        "params": params,
        "flops": {
            "per_token": flops,
            "train_tokens": train_tokens,
            "train_total_6NT": 6 * params["matmul"] * train_tokens,
            "train_total": flops["train"] * train_tokens,
            # one decoded token at context seq_len, per decode mode (lm only)
            "decode_per_token": decode_flops_by_mode(cfg, T) if cfg.task == "lm" else None,
        },
        "kv_cache": {
            **kv,
            "bytes_per_sequence_at_seq_len": kv["bytes_per_token"] * T,
        },
        "attention_scores": {
            # What a naive attention materialises per sequence and layer: the H×T×T score matrix.
            # Fused SDPA never stores it; it is here to set against the KV cache, not to add to it.
            "elements_per_layer": cfg.n_heads * T * T,
            "bytes_per_layer": cfg.n_heads * T * T * b,
        },
        "memory": {"world_size": N, "recipe": recipe_memory(recipe, N), "engines": memory_table(recipe, N)},
    }
