"""KV-cache bytes per token and per sequence, by attention kind and decode mode."""
from __future__ import annotations

from scaletool.config import ModelConfig
from scaletool.kinds.attention import attention_kind

# ---------------------------------------------------------------------------------------------
# KV cache


def cache_bytes_per_token(cfg: ModelConfig, mode: str | None = None) -> int:
    """KV-cache bytes per token, all layers, at the recipe dtype, in decode ``mode`` (None: the kind's
    default; ``scaletool.kinds.attention.MLA_MODES``)."""
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
