"""The analytic model: closed forms, config in, numbers out. No model is instantiated here.

Conventions, stated once:
- FLOPs are floating-point operations, a multiply-add counts as 2.
- "causal" attention FLOPs count the T²/2 scores a causal mask leaves (PaLM, Chowdhery et al. 2022,
  appendix B); "full" counts all T² (what FlopCounterMode and fvcore measure, since SDPA computes
  the masked tiles' cost away only inside fused kernels).
- Matmul parameters are the weights of every Linear layer, the LM head included (tied or not); the
  token-embedding lookup is a gather, no matmul; norms and biases are element-wise.
- Mixture of experts (ffn=moe): "active" parameters are those one token multiplies (dense parts,
  router, shared experts, its top-k routed experts); ``matmul_params`` and the FLOPs count those.
  The capacity-based dispatch computes every expert's full capacity buffer, so FLOPs *computed*
  (what a FLOP counter sees, the ``*_computed`` keys) count E·C/N ≈ capacity_factor·k routed experts
  per token, while *useful* FLOPs (the MFU convention, the plain keys) count k.
"""
from __future__ import annotations

from dataclasses import dataclass

from scaletool.config import ModelConfig, Recipe, expert_capacity
from scaletool.errors import RecipeError

# ---------------------------------------------------------------------------------------------
# Parameters


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    return dim if cfg.norm == "rmsnorm" else 2 * dim


def attention_params(cfg: ModelConfig) -> dict[str, int]:
    """Per-layer attention parameters by projection.

    MHA/GQA/MQA (Llama layout): wq d·H·hd, wk and wv d·KV·hd each, wo H·hd·d (+ (H+2·KV)·hd
    biases with ``qkv_bias``, as Qwen2).
    MLA (DeepSeek-V2 §2.1, V3 inference code): wq d·H·(nope+rope) or wq_a d·q_lora + q_norm q_lora +
    wq_b q_lora·H·(nope+rope); wkv_a d·(kv_lora+rope); kv_norm kv_lora; wkv_b kv_lora·H·(nope+v);
    wo H·v·d.
    """
    d, H = cfg.d_model, cfg.n_heads
    if cfg.attention != "mla":
        hd, KV = cfg.head_dim, cfg.n_kv_heads
        out = {"wq": d * H * hd, "wk": d * KV * hd, "wv": d * KV * hd, "wo": H * hd * d}
        if cfg.qkv_bias:
            out["qkv_bias"] = (H + 2 * KV) * hd
        return out
    qk, c, r = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out = {}
    if cfg.q_lora_rank == 0:
        out["wq"] = d * H * qk
    else:
        q = cfg.q_lora_rank
        out.update(wq_a=d * q, q_norm=q, wq_b=q * H * qk)
    out.update(wkv_a=d * (c + r), kv_norm=c, wkv_b=c * H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
               wo=H * cfg.v_head_dim * d)
    return out


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
    if cfg.task == "lm":
        embedding = cfg.vocab_size * d
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    else:  # grouped feature Linear layers (with bias) + BatchNorm1d weight and bias
        embedding = sum(s * w + w for s, w in zip(cfg.feature_groups, cfg.group_widths)) + 2 * d
        head = d * cfg.horizon + cfg.horizon
    final_norm = _norm_params(cfg, d)
    layers = L * (attn_layer + norms_layer) + ffn_total
    total = embedding + layers + final_norm + head
    # "Non-embedding" (Kaplan et al. 2020) leaves out the vocabulary matrices: the input embedding
    # and an untied LM head. The regression model's feature embedding and head are kept: they are small.
    non_embedding = total - (embedding + head if cfg.task == "lm" else 0)
    rule = 12 * d * d * L
    inactive = n_moe * (moe["routed"] - moe["routed_active"]) if moe else 0
    out = {
        "total": total,
        "active": total - inactive,
        "non_embedding": non_embedding,
        "embedding": embedding,
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
    attn = attention_params(cfg)
    attn_mm = sum(v for k, v in attn.items() if not k.endswith(("norm", "bias")))
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


# ---------------------------------------------------------------------------------------------
# KV cache


def kv_cache(cfg: ModelConfig) -> dict:
    """KV-cache bytes per token at the recipe dtype (DeepSeek-V2, Table 1).

    MHA/GQA/MQA: 2·n_kv_heads·head_dim per layer. MLA caches the normalised latent and the shared
    RoPE key: kv_lora_rank + qk_rope_head_dim per layer (what absorbed decoding reads). MLA's naive
    form caches full per-head keys and values: n_heads·(qk_head_dim + v_head_dim) per layer, which is
    also the MHA with the same heads and head dims that the compression ratio is taken against.
    """
    b, L, H = cfg.dtype_bytes, cfg.n_layers, cfg.n_heads
    if cfg.attention == "mla":
        elems = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        mha_equiv = H * (cfg.qk_head_dim + cfg.v_dim)
    else:
        elems = 2 * cfg.n_kv_heads * cfg.head_dim
        mha_equiv = 2 * H * cfg.head_dim
    out = {
        "elements_per_token_per_layer": elems,
        "bytes_per_token_per_layer": elems * b,
        "bytes_per_token": elems * b * L,
        "mha_equivalent_bytes_per_token": mha_equiv * b * L,
        "compression_ratio": mha_equiv / elems,
        "dtype": cfg.dtype,
    }
    if cfg.attention == "mla":
        out["naive_bytes_per_token"] = mha_equiv * b * L
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
    tp = recipe.parallel.tensor_parallel
    if tp > 1:
        if world_size % tp:
            raise RecipeError(f"parallel.world_size: {world_size} is not a multiple of parallel.tensor_parallel={tp}; "
                              "set the ranks to assume (estimate --world-size)")
        return tensor_parallel_memory(recipe, world_size, tp)
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
        "communication": communication(recipe, N),
    }


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


def tensor_parallel_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one of ``tp`` tensor-parallel ranks holds, as a config: query and K/V heads (MQA's one
    K/V head stays whole), FFN width and vocabulary divided by ``tp``; d_model, head dims and MLA's
    latent ranks unchanged (replicated). :func:`param_counts` of it is that rank's parameter count, and
    its per-layer activations are that rank's inside the split sub-layers."""
    if tp == 1:
        return cfg
    kv = cfg.n_kv_heads if cfg.attention == "mqa" else cfg.n_kv_heads // tp
    return cfg.model_copy(update={"n_heads": cfg.n_heads // tp, "n_kv_heads": kv,
                                  "intermediate_size": cfg.intermediate_size // tp, "vocab_size": cfg.vocab_size // tp})


def tensor_parallel_replicated(cfg: ModelConfig) -> list[int]:
    """Sizes of the weight tensors every tensor-parallel rank holds whole: the norms (sequence-parallel),
    MLA's latent path (wkv_a, kv_norm; wq_a, q_norm), MQA's K/V projections. Each gets one all-reduce of
    its partial gradients per step (engines.tp)."""
    d, hd = cfg.d_model, cfg.head_dim
    norm = [d] if cfg.norm == "rmsnorm" else [d, d]  # LayerNorm: weight and bias
    layer = 2 * norm
    if cfg.attention == "mla":
        layer += [d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim), cfg.kv_lora_rank]
        if cfg.q_lora_rank:
            layer += [d * cfg.q_lora_rank, cfg.q_lora_rank]
    elif cfg.attention == "mqa":
        layer += [d * hd, d * hd] + ([hd, hd] if cfg.qkv_bias else [])
    return cfg.n_layers * layer + norm


def tensor_parallel_communication(cfg: ModelConfig, tp: int, inputs: MemoryInputs, grad_accum_steps: int = 1
                                  ) -> list[dict]:
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
    The global gradient norm's all-reduce of one number per tensor is left out.
    """
    if tp == 1:
        return []
    L, gas = cfg.n_layers, grad_accum_steps
    ac = inputs.activation_checkpointing
    recomputed = L if ac == "full" else (L // inputs.selective_every if ac == "selective" else 0)
    tokens = inputs.micro_batch_size * inputs.seq_len
    activation = tokens * cfg.d_model * cfg.dtype_bytes
    per_micro = 4 * L + 2 * recomputed + 2  # per op: blocks forward and backward, recompute, embedding and final norm
    replicated = tensor_parallel_replicated(cfg)
    grad_bytes = 4 if gas > 1 else cfg.dtype_bytes
    return [
        _row("tp", "all_gather", "sub-layer inputs, final norm; embedding (backward)", gas * per_micro,
             gas * per_micro * activation, tp),
        _row("tp", "reduce_scatter", "sub-layer outputs, embedding; final norm (backward)", gas * per_micro,
             gas * per_micro * activation, tp),
        _row("tp", "all_reduce", "loss parallelism (max, sum of exp, target logit)", 3 * gas, 3 * gas * tokens * 4, tp),
        _row("tp", "all_reduce", "replicated weights' gradients", len(replicated), sum(replicated) * grad_bytes, tp),
    ]


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


def data_parallel_communication(cfg: ModelConfig, engine: str, ranks: int, *, zero_stage: int = 1,
                                grad_accum_steps: int = 1, reshard_after_forward: bool = True,
                                expert_parallel: bool = False, inputs: MemoryInputs | None = None) -> list[dict]:
    """The data-parallel engine's collectives per optimizer step, per rank of ``ranks`` (``cfg`` is what
    one rank of a tensor-parallel group holds, :func:`tensor_parallel_config`, when there is one).

    - DDP: one all-reduce of the fp32 gradients per step (``no_sync`` while accumulating), in buckets.
    - FSDP2: per micro-batch, each block's and the root's (embedding, final norm, head) 16-bit parameters
      all-gathered for the forward, the blocks again for the backward when ``reshard_after_forward`` (the
      root is not resharded); per step one reduce-scatter of the gradients per block and root, in fp32
      (the reduce dtype). Without FSDP2's padding of each tensor's first dimension to a multiple of
      ``ranks``. Expert parallelism (``inputs`` needed): the routed experts stay out of FSDP2, and each
      MoE layer's dispatch buffer (n_routed_experts × capacity × d_model) goes by all-to-all twice in
      the forward and twice in the backward.
    - ZeRO (Rajbhandari et al. 2020, §7): stage 0 all-reduces the 16-bit gradients once per step;
      stages 1 and 2 reduce-scatter them (stage 1 once per step, stage 2 every micro-batch: its gradients
      are partitioned as the backward produces them) and all-gather the updated 16-bit parameters after
      the step (2Ψ, as data parallelism); stage 3 all-gathers the parameters for every micro-batch's
      forward and backward and reduce-scatters its gradients (3Ψ per micro-batch).
    """
    if ranks == 1 or engine == "single":
        return []
    gas, p16 = grad_accum_steps, cfg.dtype_bytes  # 16-bit parameters under mixed precision, else fp32
    pc = param_counts(cfg)
    psi = pc["total"]
    if engine == "ddp":
        return [_row("dp", "all_reduce", "gradients (fp32, bucketed)", None, 4 * psi, ranks)]
    if engine == "deepspeed":
        if zero_stage == 0:
            return [_row("dp", "all_reduce", "gradients", None, p16 * psi, ranks)]
        if zero_stage < 3:
            reduces = gas if zero_stage == 2 else 1
            return [_row("dp", "reduce_scatter", "gradients", None, reduces * p16 * psi, ranks),
                    _row("dp", "all_gather", "updated parameters", None, p16 * psi, ranks)]
        return [_row("dp", "all_gather", "parameters (forward and backward)", None, 2 * gas * p16 * psi, ranks),
                _row("dp", "reduce_scatter", "gradients", None, gas * p16 * psi, ranks)]
    if engine != "fsdp":
        raise ValueError(f"unknown engine {engine!r}")
    blocks = _layer_params(cfg, expert_parallel)
    root = pc["embedding"] + pc["head"] + pc["final_norm"]
    gathers = gas * (len(blocks) * (2 if reshard_after_forward else 1) + 1)
    gathered = gas * (sum(blocks) * (2 if reshard_after_forward else 1) + root)
    rows = [_row("dp", "all_gather", "parameters (blocks and root)", gathers, gathered * p16, ranks),
            _row("dp", "reduce_scatter", "gradients (fp32)", len(blocks) + 1, 4 * (sum(blocks) + root), ranks)]
    if expert_parallel and cfg.n_moe_layers:
        slots = cfg.n_routed_experts * expert_capacity(cfg, inputs.micro_batch_size * inputs.seq_len)
        count = 4 * cfg.n_moe_layers * gas
        rows.append(_row("dp", "all_to_all", "expert dispatch and return", count,
                         count * slots * cfg.d_model * p16, ranks))
    return rows


def communication(recipe: Recipe, world_size: int | None = None, tensor_parallel: int | None = None) -> dict:
    """Per-step communication of the recipe's engine at ``world_size`` ranks, ``tensor_parallel`` of them
    per tensor-parallel group (defaults: ``parallel.world_size``, ``parallel.tensor_parallel``)."""
    p, t = recipe.parallel, recipe.train
    tp = tensor_parallel or p.tensor_parallel
    N = world_size or p.world_size
    if N % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide world_size={N}")
    dp = N // tp
    inputs = MemoryInputs(t.micro_batch_size, recipe.seq_len, t.activation_checkpointing, t.selective_every)
    local = tensor_parallel_config(recipe.model, tp)
    rows = tensor_parallel_communication(recipe.model, tp, inputs, t.grad_accum_steps)
    rows += data_parallel_communication(local, p.engine, dp, zero_stage=p.zero_stage, grad_accum_steps=t.grad_accum_steps,
                                        reshard_after_forward=p.reshard_after_forward,
                                        expert_parallel=p.expert_parallel, inputs=inputs)
    by_group = {g: sum(r["wire_bytes"] for r in rows if r["group"] == g) for g in ("tp", "dp")}
    return {"engine": p.engine, "world_size": N, "tensor_parallel": tp, "data_parallel": dp, "collectives": rows,
            "tp_wire_bytes": by_group["tp"], "dp_wire_bytes": by_group["dp"],
            "wire_bytes": by_group["tp"] + by_group["dp"]}


def tensor_parallel_memory(recipe: Recipe, world_size: int, tensor_parallel: int) -> dict:
    """Peak bytes per GPU under FSDP2 × tensor parallelism (engines.fsdp with parallel.tensor_parallel).

    Each rank holds :func:`tensor_parallel_config`'s model (sharded weights divided by the group size,
    replicated ones whole) and FSDP2 shards it over ``world_size / tensor_parallel`` data-parallel ranks:
    :func:`training_memory` of that model gives the states, FSDP2's buffers and the activations of the
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
    local = tensor_parallel_config(cfg, tp)
    inputs = MemoryInputs(t.micro_batch_size, recipe.seq_len, t.activation_checkpointing, t.selective_every)
    row = training_memory(local, "fsdp", dp, inputs, reshard_after_forward=recipe.parallel.reshard_after_forward)
    res = cfg.dtype_bytes  # the residual stream is 16-bit under FSDP2's mixed precision, fp32 otherwise
    ac, every = inputs.activation_checkpointing, inputs.selective_every
    kept = sum(1 if ac == "full" or (ac == "selective" and (i + 1) % every == 0) else 2 for i in range(cfg.n_layers)) + 1
    saving = int(inputs.micro_batch_size * inputs.seq_len * res * cfg.d_model * kept * (1 - 1 / tp))
    return {**row, "world_size": world_size, "tensor_parallel": tp, "data_parallel": dp,
            "params_per_rank": param_counts(local)["total"], "sequence_parallel_saving_bytes": saving,
            "activations_bytes": row["activations_bytes"] - saving, "total_bytes": row["total_bytes"] - saving}
