"""Parameter counts: exact per component, matmul parameters, and the 12·d²·L rule of thumb."""
from __future__ import annotations

from scaletool.config import ModelConfig
from scaletool.kinds.attention import attention_kind, position_kind
from scaletool.kinds.attention import matmul_params as matmul_params_of

# ---------------------------------------------------------------------------------------------
# Parameters


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    return dim if cfg.norm == "rmsnorm" else 2 * dim


def attention_params(cfg: ModelConfig) -> dict[str, int]:
    """Per-layer attention parameters by projection, named as the module's attributes (the kind's
    closed form, ``scaletool.kinds.attention``).

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
