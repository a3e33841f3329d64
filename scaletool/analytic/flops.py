"""FLOPs per token for training and decoding (a multiply-add counts as 2; causal and full attention)."""
from __future__ import annotations

from scaletool.analytic.params import attention_params, matmul_params, moe_params
from scaletool.config import ModelConfig, expert_capacity
from scaletool.kinds.attention import attention_kind
from scaletool.kinds.attention import matmul_params as matmul_params_of

# ---------------------------------------------------------------------------------------------
# FLOPs


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
    """Forward attention-score FLOPs per token, all layers: QKᵀ (2·H·T·d_qk) plus AV (2·H·T·d_v).

    Full: 2·L·H·T·(d_qk + d_v). Causal halves it (PaLM appendix B counts T/2 keys on average).
    """
    full = 2 * cfg.n_layers * cfg.n_heads * seq_len * (cfg.qk_head_dim + cfg.v_dim)
    return full / 2 if causal else float(full)


def routed_experts_computed(cfg: ModelConfig, tokens: int | None = None) -> float:
    """Routed experts the dispatch computes per token. Dropless: exactly k (no padding, no drops).
    Capacity: E·C/N for a dispatch of N = ``tokens`` tokens (exact, C from :func:`expert_capacity`),
    or min(capacity_factor·k, E) when N is not given."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if cfg.moe_dispatch == "dropless":
        return float(k)
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


def gemm_shapes(cfg: ModelConfig, tokens: int) -> list[tuple[str, int, int, int, int]]:
    """Every GEMM of one forward over ``tokens`` tokens: (name, m, n, k, count). Backward runs each
    shape twice more (input and weight gradients)."""
    d, L = cfg.d_model, cfg.n_layers
    out = []
    for name, p in attention_params(cfg).items():
        if name.endswith(("norm", "bias")) or p == 0:
            continue
        k = {"wo": p // d, "wkv_b": cfg.kv_lora_rank, "wq_b": cfg.q_lora_rank}.get(name, d)
        out.append((f"attn.{name}", tokens, p // k, k, L))
    dense = L - cfg.n_moe_layers
    mats = 3 if cfg.ffn in ("swiglu", "moe") else 2
    if dense and cfg.intermediate_size:
        out.append(("ffn", tokens, cfg.intermediate_size, d, dense * mats))
    if cfg.n_moe_layers:
        E, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        per_expert = max(1, round(tokens * routed_experts_computed(cfg, tokens) / E))
        out.append(("moe.router", tokens, E, d, cfg.n_moe_layers))
        out.append(("moe.experts", per_expert, i, d, cfg.n_moe_layers * E * 3))
        if cfg.n_shared_experts:
            out.append(("moe.shared", tokens, cfg.n_shared_experts * i, d, cfg.n_moe_layers * 3))
    if cfg.task == "lm":
        out.append(("lm_head", tokens, cfg.vocab_size, d, 1))
    else:
        out.append(("head", max(1, tokens // max(1, cfg.max_seq_len)), cfg.horizon, d, 1))
    return out
