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
  The dropless dispatch (``moe_dispatch: dropless``) computes exactly k experts per token, so FLOPs
  *computed* (what a FLOP counter sees, the ``*_computed`` keys) equal *useful* FLOPs (the MFU
  convention, the plain keys). The capacity dispatch computes every expert's full capacity buffer:
  E·C/N ≈ capacity_factor·k routed experts per token computed, k useful.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from scaletool.attention_kinds import attention_kind, position_kind
from scaletool.attention_kinds import matmul_params as matmul_params_of
from scaletool.config import ModelConfig, Recipe, expert_capacity
from scaletool.errors import RecipeError

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
#
# Peak bytes per GPU of one training step, modelled in two phases, each the largest sum of tensors
# alive at one moment (every phase is a dict of the components below, summing to its total):
#
# - ``backward``: the forward and backward pass. The forward never exceeds the start of the
#   backward (everything it saves is still alive then, plus the loss gradient), so the phase is
#   evaluated at the moments the backward passes through: the loss, the head, every block (top
#   to bottom) and the embedding. Activations shrink and gradients grow along the way; which
#   moment is largest depends on the engine, the micro-batch and checkpointing.
# - ``optimizer_step``: after the backward; activations are gone, the optimizer's own
#   temporaries appear (DeepSpeed's fp32 copy of the gradient partition, foreach AdamW's sqrt).
#
# Components (the same six keys for every engine and phase):
#   weights      parameters the engine keeps (fp32 for single/DDP/FSDP, 16-bit under DeepSpeed)
#   gradients    gradient storage alive at that moment (engine-specific, see the engine functions)
#   optimizer    AdamW m and v (and DeepSpeed's fp32 master copy)
#   activations  what autograd keeps for the backward (under autocast also the 16-bit weight copies
#                the matmuls saved), and the checkpointed block being recomputed
#   buffers      the engine's communication and gathering buffers
#   temporaries  short-lived tensors of the moment: the loss gradient, the 16-bit weight gradient on
#                its way to the engine, the optimizer's flat and fp32 gradient copies


@dataclass(frozen=True)
class MemoryInputs:
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str = "none"  # none | full | selective
    selective_every: int = 2


#: Engine defaults the estimate depends on, in elements: scaletool's reduce bucket
#: (``scaletool.engines.deepspeed.DEFAULTS``) and DeepSpeed's own ZeRO-3 defaults
#: (deepspeed/runtime/zero/config.py: stage3_max_reuse_distance, stage3_prefetch_bucket_size,
#: sub_group_size).
ZERO_REDUCE_BUCKET = 500_000_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO3_PREFETCH_BUCKET = 50_000_000
ZERO3_SUB_GROUP_SIZE = 1_000_000_000

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers", "temporaries")
PHASES = ("backward", "optimizer_step")


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings the memory model reads; the defaults are what scaletool configures."""
    zero_stage: int = 1
    reshard_after_forward: bool = True
    expert_parallel: bool = False
    fused_optimizer: bool = True  # torch's fused AdamW (the CUDA default) or foreach
    reduce_bucket: float = ZERO_REDUCE_BUCKET
    overlap_comm: bool = True  # DeepSpeed ZeRO-1/2: two IPG buckets instead of one
    max_reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE
    prefetch_bucket: float = ZERO3_PREFETCH_BUCKET
    sub_group_size: float = ZERO3_SUB_GROUP_SIZE


def _activation_bytes_per_token_per_layer(cfg: ModelConfig, moe: bool = False, res: int = 4) -> float:
    """Bytes autograd keeps per token in one block, eager mode, mixed precision.

    Counted tensor by tensor (residual stream of ``res`` bytes, 16-bit matmul inputs): each norm
    keeps its input (res·d) and the 16-bit cast its matmul reads (2d); fused SDPA keeps q, k, v and the output
    (no T×T scores) plus an fp32 log-sum-exp per head (MLA's v is a view into ``wkv_b``'s output, which
    therefore stays whole: H·(qk_nope_head_dim + v_head_dim)); SwiGLU keeps gate, up, silu(gate) and their
    product (4 tensors of i), GELU/ReLU the pre-activation and activation (2 of i).
    A MoE block (``moe``) keeps the router's fp32 logits and scores (2·E), the dispatch buffer
    (d per computed slot: k per token dropless, E·C/N ≈ capacity_factor·k with capacity) and each slot's SwiGLU
    (4·i_moe), the k gathered expert outputs (k·d), and the shared experts' SwiGLU (4·n_shared·i_moe).
    """
    d, H, a = cfg.d_model, cfg.n_heads, 2 if cfg.dtype != "fp32" else 4
    norms = 2 * (res * d + a * d)
    if cfg.attention == "mla":
        c, r, qk, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim, cfg.v_dim
        # q, k, out; v is a view into wkv_b's output, so SDPA's saved v keeps the no-RoPE keys alive with it
        attn = a * (H * qk + H * qk + H * (cfg.qk_nope_head_dim + v) + H * v)
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


@dataclass(frozen=True)
class _Unit:
    """One stop of the backward (the head, a block, the embedding), in the order the backward visits them.

    Bytes are totals for the micro-batch; parameter counts are elements."""
    name: str
    params: int  # parameters whose gradients it produces
    largest: int  # its largest parameter
    gathered: int  # parameters FSDP / ZeRO-3 gather for it (expert-parallel experts stay local)
    saved: float  # activation bytes it keeps from the forward until its backward
    live: float  # activation bytes alive during its backward (recomputed when checkpointed)
    temp: float  # temporaries of its backward
    checkpointed: bool = False


def _units(cfg: ModelConfig, inputs: MemoryInputs, *, autocast: bool, expert_parallel: bool) -> tuple[list[_Unit], float]:
    """The backward's stops (head, blocks L-1..0, embedding) and the loss gradient's bytes.

    Language model head: the final norm keeps its input (res·d) and output (the head matmul's input,
    a·d); of the cross-entropy over ``logits.float()`` autograd keeps only log_softmax's fp32 output
    (4·V per token: the 16-bit logits and their fp32 copy are freed when the forward returns). At the
    loss, NLL's gradient and log_softmax's gradient (fp32, 8·V per token) exist next to it
    (aten nll_loss_backward, _log_softmax_backward_data); at the head, the logits' gradient in the
    compute dtype (a·V) and the head weight's gradient before it reaches the engine (a·V·d).
    Under autocast (single, DDP: fp32 weights, 16-bit compute) every matmul saves the 16-bit copy of
    its weight that autocast made (torch autocast's weight cast cache), 2 bytes per matmul parameter,
    until its backward; FSDP2 and DeepSpeed compute with their own 16-bit parameters instead.
    """
    mixed = cfg.dtype != "fp32"
    res = a = cfg.dtype_bytes if mixed else 4  # 16-bit residual stream under mixed precision (see embed())
    tokens = inputs.micro_batch_size * inputs.seq_len
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    pc = param_counts(cfg)
    attn = attention_params(cfg)
    attn_total = sum(attn.values())
    attn_matmul = sum(v for k, v in attn.items() if not k.endswith("norm"))
    norms = pc["per_layer"]["norms"]
    moe = moe_params(cfg) if cfg.n_moe_layers else None
    copy = 2 if autocast and mixed else 0  # bytes of autocast's 16-bit weight copy per matmul parameter
    ac = inputs.activation_checkpointing
    dense_layers = L - cfg.n_moe_layers
    blocks = []
    for i in reversed(range(L)):
        is_moe = i >= dense_layers
        ffn = moe["gate"] + moe["routed"] + moe["shared"] if is_moe else ffn_params(cfg)
        # the largest single tensor: a stacked expert weight (E·d·i_moe) or one FFN matrix
        largest = max(max(attn.values()), moe["routed"] // 3 if is_moe else ffn // (3 if cfg.ffn in ("swiglu", "moe") else 2))
        gathered = attn_total + norms + ffn - (moe["routed"] if is_moe and expert_parallel else 0)
        full = tokens * _activation_bytes_per_token_per_layer(cfg, moe=is_moe, res=res) + copy * (attn_matmul + ffn)
        ckpt = ac == "full" or (ac == "selective" and (i + 1) % inputs.selective_every == 0)
        blocks.append(_Unit(f"block {i}", attn_total + norms + ffn, largest, gathered,
                            saved=tokens * res * d if ckpt else full, live=full, temp=0.0, checkpointed=ckpt))
    final_norm = pc["final_norm"]
    if cfg.task == "lm":
        head_mm = V * d  # the LM head matmul (the embedding matrix when tied)
        head_params = head_mm + final_norm  # a tied matrix's gradient first appears here too
        norm_saved = tokens * (res + a) * d
        head = _Unit("head", head_params, head_mm, head_params, saved=norm_saved + tokens * 4 * V + copy * head_mm,
                     live=norm_saved + copy * head_mm, temp=tokens * a * V + a * head_mm)
        emb_params = 0 if cfg.tie_embeddings else V * d
        loss_temp = tokens * 8 * V
    else:  # regression: the head reads the last time step only
        head_params = pc["head"] + final_norm
        head = _Unit("head", head_params, pc["head"], head_params, saved=tokens * res * d * 3, live=0.0, temp=0.0)
        emb_params = pc["embedding"]
        loss_temp = 0.0
    embedding = _Unit("embedding", emb_params, emb_params, emb_params, saved=0.0, live=0.0, temp=0.0)
    return [head, *blocks, embedding], loss_temp


def _timeline(units: list[_Unit], loss_temp: float, states: dict, grads_at, buffers_at,
              temp_at=None) -> tuple[dict, str]:
    """The backward's largest moment as components, and its name.

    ``grads_at(i, done)`` and ``buffers_at(i)`` give the engine's gradient and buffer bytes at stop
    ``i`` (-1: the loss) once ``done`` parameters have their gradients; ``temp_at(i, done)`` adds
    engine temporaries."""
    saved_from = [0.0] * (len(units) + 1)  # activations still kept at and below stop i
    for i in reversed(range(len(units))):
        saved_from[i] = saved_from[i + 1] + units[i].saved
    best, where, done = None, "", 0
    for i in range(-1, len(units)):
        if i < 0:
            act, temp = saved_from[0], loss_temp
        else:
            done += units[i].params
            act, temp = saved_from[i + 1] + units[i].live, units[i].temp
        extra = temp_at(i, done) if temp_at else 0.0
        comp = {**states, "gradients": grads_at(i, done), "activations": act, "buffers": buffers_at(i),
                "temporaries": temp + extra}
        if best is None or sum(comp.values()) > sum(best.values()):
            best, where = comp, ("loss" if i < 0 else units[i].name)
    return best, where


def _group_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """Elements in scaletool's two AdamW groups (``engines.optim.param_groups``): decayed matrices and
    embeddings (dim >= 2), and the undecayed norms and biases."""
    pc = param_counts(cfg)
    small = pc["norms"]
    small += cfg.n_layers * sum(v for k, v in attention_params(cfg).items() if k.endswith(("norm", "bias")))
    if cfg.task == "regression":
        small += sum(cfg.group_widths) + 2 * cfg.d_model + cfg.horizon  # Linear biases, BatchNorm
    return pc["total"] - small, small


def _torch_engine(cfg, engine, N, units, loss_temp, s: EngineSettings) -> dict:
    """single, DDP, FSDP2: fp32 parameters, gradients and AdamW m, v (16Ψ), FSDP2 sharding all of it.

    - single: gradients are allocated as the backward produces them (``zero_grad(set_to_none=True)``
      frees them after the step; AccumulateGrad steals the fresh gradient, no copy).
    - DDP (``gradient_as_bucket_view=True``): the reducer's flat buckets are the gradients (4Ψ,
      allocated at construction and kept: ``.grad`` are views into them); extra is one parameter's fresh
      gradient at a time, copied into its bucket view and then freed
      (torch/csrc/distributed/c10d/reducer.cpp, ``Reducer::mark_variable_ready_dense``), and, once per
      run, a second set of buckets: the second step's forward rebuilds them in gradient-arrival order
      (torch/nn/parallel/distributed.py ``_pre_forward`` → ``Reducer::rebuild_buckets`` →
      ``initialize_buckets``), and the first set stayed allocated through that step's backward in the
      GPU validation (recipes/benchmarks/memory_phases.md: +4Ψ in 7 of 8 two-GPU cells; what still
      references them was not traced). The estimate counts them: it is the run's peak, not a later step's
      (``train`` reports both: ``memory/peak_allocated_bytes`` over the measured steps after warm-up, where
      4x H100 runs were 4Ψ under this estimate, and ``memory/run_peak_allocated_bytes`` over the whole run).
    - FSDP2: sharded fp32 gradients appear as each block's reduce-scatter finishes. Buffers
      (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_all_gather``,
      ``foreach_reduce``): the root (embedding, head, final norm; ``reshard_after_forward=False``)
      stays unsharded through the backward, and its unsharded gradients wait for its reduce-scatter
      at the end; at a block, its unsharded 16-bit parameters and the prefetched next block's (all
      blocks not yet reached with ``reshard_after_forward=False``), its unsharded gradients and the
      fp32 reduce-scatter input (reduce_dtype fp32). At N = 1 the all-gather is a copy, so the same.
    - Step: fused AdamW (torch/optim/adam.py ``_fused_adam``) updates in place, no temporaries;
      foreach AdamW (``_multi_tensor_adam``) allocates ``exp_avg_sq_sqrt``, one fp32 tensor per
      parameter of the group it is stepping: 4 bytes × the larger AdamW group.
    """
    psi = param_counts(cfg)["total"]
    shard = N if engine == "fsdp" else 1
    states = {"weights": 4 * psi / shard, "optimizer": 8 * psi / shard}
    if engine == "single":
        def grads_at(i, done): return 4 * done
        def buffers_at(i): return 0.0
    elif engine == "ddp":
        def grads_at(i, done): return 4 * psi
        def buffers_at(i): return 4 * psi + (4 * units[i].largest if i >= 0 else 0.0)
    else:
        p = cfg.dtype_bytes if cfg.dtype != "fp32" else 4
        root = units[0].gathered + units[-1].gathered
        blocks = [u.gathered for u in units[1:-1]]

        def grads_at(i, done): return 4 * done / N

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
    backward, where = _timeline(units, loss_temp, states, grads_at, buffers_at)
    temp = 0.0 if s.fused_optimizer else 4 * max(_group_sizes(cfg)) / shard
    step = {**states, "gradients": 4 * psi / shard, "activations": 0.0, "buffers": 0.0, "temporaries": temp}
    return {"phases": {"backward": backward, "optimizer_step": step}, "backward_peak_at": where,
            "weights_bytes": states["weights"], "gradients_bytes": 4 * psi / shard, "optimizer_bytes": states["optimizer"]}


def _zero12(cfg, N, units, loss_temp, s: EngineSettings) -> dict:
    """DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, ``DeepSpeedZeroOptimizer``) as
    scaletool configures it: 16-bit parameters (2Ψ, whole), fp32 master, m, v sharded (12Ψ/N),
    contiguous_gradients and overlap_comm on.

    - Backward: at the first gradient hook ``setup_buckets`` allocates the IPG buckets, 2 × reduce_bucket
      16-bit elements with overlap_comm (one without), released in ``independent_gradient_partition_epilogue``;
      gradients are copied into them as they come. At the first bucket flush (``reduce_ipg_grads``)
      ``copy_grads_in_partition`` allocates ``grads_in_partition``, 16-bit, this rank's partition (Ψ/N):
      for stage 2 and also for stage 1, whose hooks reduce during the backward once overlap_comm is on
      (``process_gradients``); stage 1 without overlap_comm keeps every 16-bit gradient (2Ψ).
    - Step (``step``): per parameter group, ``flatten(averaged_gradients)`` makes a flat 16-bit copy of the
      group's partition and ``.to(fp32)`` the fp32 gradient the optimizer reads, while
      ``grads_in_partition`` is still held by the groups' views: 2P + 4P on top of it for the larger group
      (P its partition; an fp32 model skips the cast). The 16-bit all-gather of the updated partitions
      writes into the flat parameter groups in place (runtime/utils.py ``all_gather_dp_groups``:
      ``all_gather_into_tensor``, or narrow views per allgather_bucket_size), so it adds nothing.
      DeepSpeed's own estimator counts this step copy since PR #5099
      (``estimate_zero2_model_states_mem_needs``: 2Ψ + 18Ψ/N = 16-bit grads + fp32 grads + master + m, v).
    - Stage 0 (not in the GPU validation): no sharding, no IPG buckets; 16-bit training runs DeepSpeed's
      ``FP16_Optimizer`` (runtime/fp16/fused_optimizer.py ``step``), which casts every gradient to fp32 and
      flattens the casts: 4P + 4P for the larger group.
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
      sum to under max_reuse_distance/2); each stop's own parameters and the prefetched next stop's (up to
      prefetch_bucket elements) are gathered while it runs. A bucket flush (``__reduce_and_partition_ipg_grads``
      → ``reduce_scatter_coalesced``) concatenates the bucket's gradients into one 16-bit buffer (torch.cat).
    - Step: ``_partition_all_parameters`` releases what is gathered; per sub-group
      (``_prepare_fp32_grad_for_sub_group``) ``flatten(...).to(fp32)`` makes a 16-bit flat copy and the fp32
      gradient of the sub-group's partition, P = min(group, sub_group_size) elements / N: 2P + 4P.
    """
    psi = param_counts(cfg)["total"]
    mixed = cfg.dtype != "fp32"
    g16 = cfg.dtype_bytes if mixed else 4
    states = {"weights": g16 * psi / N, "optimizer": (12 if mixed else 8) * psi / N}
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
        ahead = units[i + 1].gathered if i < last and not kept[i + 1] else 0
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


def training_memory(cfg: ModelConfig, engine: str, world_size: int, inputs: MemoryInputs,
                    settings: EngineSettings | None = None, **overrides) -> dict:
    """Peak bytes per GPU of a training step, as the larger of its two phases (see the section comment).

    Model states follow ZeRO (Rajbhandari et al. 2020, §3) as each engine really stores them: torch-native
    engines keep fp32 parameters, gradients and AdamW m, v (16Ψ; FSDP2 shards all of it); DeepSpeed keeps
    16-bit parameters and gradients and an fp32 master with m, v (12Ψ), sharded per ZeRO stage. The
    engine-specific buffers and temporaries are documented, with their DeepSpeed and torch sources, in
    :func:`_torch_engine`, :func:`_zero12` and :func:`_zero3`; activations in :func:`_units` and
    :func:`_activation_bytes_per_token_per_layer` (eager mode).

    MoE: model states count every parameter (all experts are trained). With ``expert_parallel``
    (FSDP2) each rank keeps 1/N of the routed experts itself: states stay Ψ/N per rank, but FSDP's
    per-block all-gather no longer includes the routed experts.

    ``settings`` (or keyword ``overrides`` of its fields) describes the engine's configuration.
    Returns the phases (components per phase), the phase that sets ``total_bytes``, where the backward
    peaks, and the model states and saved activations as single figures.
    """
    s = settings or EngineSettings()
    if overrides:
        s = replace(s, **overrides)
    N = world_size
    autocast = engine in ("single", "ddp")
    units, loss_temp = _units(cfg, inputs, autocast=autocast, expert_parallel=s.expert_parallel)
    if engine in ("single", "ddp", "fsdp"):
        out = _torch_engine(cfg, engine, N, units, loss_temp, s)
    elif engine == "deepspeed":
        out = (_zero3 if s.zero_stage >= 3 else _zero12)(cfg, N, units, loss_temp, s)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    phases = {name: {c: int(out["phases"][name][c]) for c in COMPONENTS} for name in PHASES}
    totals = {name: sum(comp.values()) for name, comp in phases.items()}
    phase = max(PHASES, key=lambda name: totals[name])
    peak = phases[phase]
    tokens = inputs.micro_batch_size * inputs.seq_len
    blocks = units[1:-1]
    return {
        "engine": engine, "world_size": N, "zero_stage": s.zero_stage if engine == "deepspeed" else None,
        "weights_bytes": int(out["weights_bytes"]), "gradients_bytes": int(out["gradients_bytes"]),
        "optimizer_bytes": int(out["optimizer_bytes"]),
        # what autograd keeps at the end of the forward (the loss gradient not included)
        "activations_bytes": int(sum(u.saved for u in units)),
        "activations_per_token_per_layer_bytes": int(sum(u.live for u in blocks) / len(blocks) / tokens) if blocks else 0,
        # the engine's buffers and the temporaries at the peak: what the model states and activations leave out
        "transient_bytes": peak["buffers"] + peak["temporaries"],
        "phases": phases, "phase": phase, "backward_peak_at": out["backward_peak_at"],
        "total_bytes": totals[phase],
    }


def engine_settings(recipe: Recipe) -> EngineSettings:
    """The :class:`EngineSettings` a recipe selects: parallel.* and the DeepSpeed passthrough's numbers
    (unknown or malformed passthrough values fall back to the defaults DeepSpeed itself would use)."""
    t, p = recipe.train, recipe.parallel
    zero = p.deepspeed.get("zero_optimization") or {}

    def number(key: str, default: float) -> float:
        try:
            return float(zero.get(key, default))
        except (TypeError, ValueError):
            return default

    return EngineSettings(
        zero_stage=p.zero_stage, reshard_after_forward=p.reshard_after_forward, expert_parallel=p.expert_parallel,
        # the estimate is per GPU, where make_adamw picks the fused AdamW unless told otherwise
        fused_optimizer=t.fused_optimizer is not False,
        reduce_bucket=number("reduce_bucket_size", ZERO_REDUCE_BUCKET),
        overlap_comm=bool(zero.get("overlap_comm", True)),
        max_reuse_distance=number("stage3_max_reuse_distance", ZERO3_MAX_REUSE_DISTANCE),
        prefetch_bucket=number("stage3_prefetch_bucket_size", ZERO3_PREFETCH_BUCKET),
        sub_group_size=number("sub_group_size", ZERO3_SUB_GROUP_SIZE))


#: the rows of :func:`memory_table`: (label, engine, ZeRO stage)
TABLE_ENGINES = [("single", "single", 0), ("ddp", "ddp", 0), ("fsdp", "fsdp", 0),
                 ("zero1", "deepspeed", 1), ("zero2", "deepspeed", 2), ("zero3", "deepspeed", 3)]


def memory_table(recipe: Recipe, world_size: int | None = None) -> list[dict]:
    """Training memory for single, DDP, FSDP and ZeRO-1/2/3, with and without checkpointing, under the
    recipe's engine settings (single only at world size 1)."""
    N = world_size or recipe.parallel.world_size
    t = recipe.train
    base = engine_settings(recipe)
    rows = []
    for ac in ("none", "full"):
        inp = MemoryInputs(t.micro_batch_size, recipe.seq_len, ac, t.selective_every)
        for label, engine, stage in TABLE_ENGINES:
            if engine == "single" and N > 1:
                continue
            settings = replace(base, zero_stage=stage or base.zero_stage,
                               expert_parallel=base.expert_parallel and engine == "fsdp")
            row = training_memory(recipe.model, engine, 1 if engine == "single" else N, inp, settings)
            rows.append({**row, "activation_checkpointing": ac, "label": label})
    return rows


def recipe_memory(recipe: Recipe, world_size: int) -> dict:
    """Memory estimate for the engine and settings the recipe itself selects."""
    tp = recipe.parallel.tensor_parallel
    if tp > 1:
        if world_size % tp:
            raise RecipeError(f"parallel.world_size: {world_size} is not a multiple of parallel.tensor_parallel={tp}; "
                              "set the ranks to assume (estimate --world-size)")
        return tensor_parallel_memory(recipe, world_size, tp)
    t = recipe.train
    inp = MemoryInputs(t.micro_batch_size, recipe.seq_len, t.activation_checkpointing, t.selective_every)
    return training_memory(recipe.model, recipe.parallel.engine, world_size, inp, engine_settings(recipe))


def count_memory(cfg: ModelConfig, batch: int, seq_len: int) -> dict:
    """Bytes ``scaletool count`` needs on a real device: the model in fp32, and one forward and backward
    at ``batch`` sequences without autocast (FlopCounterMode runs both), i.e. the backward phase of a
    ``single`` step with no optimizer state and fp32 compute."""
    fp32 = cfg.model_copy(update={"dtype": "fp32"})
    units, loss_temp = _units(fp32, MemoryInputs(batch, seq_len), autocast=False, expert_parallel=False)
    psi = param_counts(cfg)["total"]
    peak, _ = _timeline(units, loss_temp, {"weights": 4 * psi, "optimizer": 0.0},
                        lambda i, done: 4 * done, lambda i: 0.0)
    parts = {k: int(v) for k, v in peak.items() if k != "optimizer"}
    return {**parts, "total_bytes": sum(parts.values())}


# ---------------------------------------------------------------------------------------------
# Everything at once


def model_summary(cfg: ModelConfig) -> dict:
    """The shape of the model in a few keys, as estimate and count both report it."""
    return {"attention": cfg.attention, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "task": cfg.task}


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
        "model": model_summary(cfg),
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
        # the recipe's own engine: single runs one process whatever the world size asked for
        "memory": {"world_size": N, "recipe": recipe_memory(recipe, 1 if recipe.parallel.engine == "single" else N),
                   "engines": memory_table(recipe, N)},
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
    # the saved norm inputs are live through the backward and gone by the optimizer step: the saving comes
    # off the backward phase's activations, and the peak phase is chosen again
    phases = {name: dict(comp) for name, comp in row["phases"].items()}
    phases["backward"]["activations"] = max(0, phases["backward"]["activations"] - saving)
    totals = {name: sum(comp.values()) for name, comp in phases.items()}
    phase = max(totals, key=totals.get)
    return {**row, "world_size": world_size, "tensor_parallel": tp, "data_parallel": dp,
            "params_per_rank": param_counts(local)["total"], "sequence_parallel_saving_bytes": saving,
            "activations_bytes": row["activations_bytes"] - saving, "phases": phases, "phase": phase,
            "transient_bytes": phases[phase]["buffers"] + phases[phase]["temporaries"], "total_bytes": totals[phase]}
