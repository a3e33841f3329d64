"""Hugging Face ``config.json`` -> recipe ``model`` section.

Llama, Mistral, Qwen2/Qwen3-style dense models and DeepSeek-V2/V3. A setting the model family does not
implement (mixture-of-experts layers, RoPE scaling, sliding windows...) is an error that names it;
``drop`` lists the features the user accepts to lose, and the result records what was dropped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scaletool.config import RecipeError, recipe_from_dict

DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"}
DEEPSEEK_TYPES = {"deepseek_v2", "deepseek_v3"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "gelu", "gelu_new": "gelu", "relu": "relu"}

# feature name -> (predicate on the config, what it is)
_UNSUPPORTED = {
    "moe": (lambda c: bool(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts")),
            "mixture-of-experts FFN layers"),
    "rope_scaling": (lambda c: bool(c.get("rope_scaling")), "RoPE scaling (YaRN / llama3 / linear)"),
    "sliding_window": (lambda c: bool(c.get("sliding_window")) and c.get("use_sliding_window", True),
                       "sliding-window attention"),
    "attention_bias": (lambda c: bool(c.get("attention_bias")) and c.get("model_type") not in ("qwen2",),
                       "biases on every attention projection (o_proj included)"),
    "mlp_bias": (lambda c: bool(c.get("mlp_bias")), "biases in the MLP"),
    "mtp": (lambda c: bool(c.get("num_nextn_predict_layers")), "multi-token-prediction modules"),
}


def _get(cfg: dict, key: str, *alts: str, default: Any = None):
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def model_section(cfg: dict, drop: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Translate one HF config; returns (model section, features dropped)."""
    mtype = cfg.get("model_type")
    if mtype not in DENSE_TYPES | DEEPSEEK_TYPES:
        known = ", ".join(sorted(DENSE_TYPES | DEEPSEEK_TYPES))
        raise RecipeError(f"model_type {mtype!r} is not supported (known: {known})")
    unknown_drop = set(drop) - set(_UNSUPPORTED)
    if unknown_drop:
        raise RecipeError(f"--drop {', '.join(sorted(unknown_drop))}: unknown feature "
                          f"(droppable: {', '.join(_UNSUPPORTED)})")
    present = [name for name, (pred, _) in _UNSUPPORTED.items() if pred(cfg)]
    missing = [n for n in present if n not in drop]
    if missing:
        raise RecipeError([f"{n}: {_UNSUPPORTED[n][1]} not supported by scaletool's model family "
                           f"(pass --drop {n} to import without it)" for n in missing])
    act = cfg.get("hidden_act", "silu")
    if act not in _ACTS:
        raise RecipeError(f"hidden_act {act!r} not supported (known: {', '.join(_ACTS)})")
    m: dict[str, Any] = {
        "d_model": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": cfg["num_attention_heads"],
        "ffn": _ACTS[act],
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": _get(cfg, "max_position_embeddings", default=2048),
        "rope_theta": float(_get(cfg, "rope_theta", default=10000.0)),
        "norm_eps": float(_get(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "dtype": _DTYPES.get(_get(cfg, "torch_dtype", "dtype", default="bfloat16"), "bf16"),
    }
    if mtype in DEEPSEEK_TYPES:
        m.update(attention="mla", kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank") or 0,
                 qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                 v_head_dim=cfg["v_head_dim"])
    else:
        kv = _get(cfg, "num_key_value_heads", default=m["n_heads"])
        m["attention"] = "mha" if kv == m["n_heads"] else ("mqa" if kv == 1 else "gqa")
        if m["attention"] == "gqa":
            m["n_kv_heads"] = kv
        hd = cfg.get("head_dim")
        if hd and hd != m["d_model"] // m["n_heads"]:
            m["head_dim"] = hd
        partial = cfg.get("partial_rotary_factor")
        if partial and partial != 1.0:
            m["qk_rope_head_dim"] = int((hd or m["d_model"] // m["n_heads"]) * partial)
        if mtype == "qwen2" or (cfg.get("attention_bias") and mtype in ("qwen2",)):
            m["qkv_bias"] = True
    dropped = [n for n in present if n in drop]
    return m, dropped


def recipe_from_hf(path: str | Path, drop: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Read a config.json and return a validated recipe dict (``model`` section filled) and the drops."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{p}: no such file")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{p}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise RecipeError(f"{p}: expected a JSON object")
    try:
        model, dropped = model_section(cfg, drop)
    except KeyError as e:
        raise RecipeError(f"{p}: missing key {e.args[0]!r}") from None
    raw = {"model": model}
    recipe = recipe_from_dict(raw, str(p))  # validate now: a bad config fails here, not later
    out = {"model": {k: v for k, v in recipe.model.model_dump().items() if k in model}}
    return out, dropped
