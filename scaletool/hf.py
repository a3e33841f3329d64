"""Hugging Face ``config.json`` -> recipe ``model`` section.

Llama, Mistral, Qwen2/Qwen3-style dense models and DeepSeek-V2/V3, the latter with their
mixture-of-experts FFNs (routing: V2's softmax with greedy or group-limited top-k, V3's sigmoid with
the selection bias and group-limited ``noaux_tc``). A setting the model family does not implement
(RoPE scaling, sliding windows, V3's multi-token-prediction module, FP8 weights...) is an error that
names it; ``drop`` lists the features the user accepts to lose, and the result records what was
dropped. ``--drop moe`` on a DeepSeek config imports its dense twin (every layer the dense FFN).
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
            "mixture-of-experts FFN layers"),  # supported for DeepSeek types (_MOE_KEYS)
    "rope_scaling": (lambda c: bool(c.get("rope_scaling")), "RoPE scaling (YaRN / llama3 / linear)"),
    "sliding_window": (lambda c: bool(c.get("sliding_window")) and c.get("use_sliding_window", True),
                       "sliding-window attention"),
    "attention_bias": (lambda c: bool(c.get("attention_bias")) and c.get("model_type") not in ("qwen2",),
                       "biases on every attention projection (o_proj included)"),
    "mlp_bias": (lambda c: bool(c.get("mlp_bias")), "biases in the MLP"),
    "mtp": (lambda c: bool(c.get("num_nextn_predict_layers")), "multi-token-prediction modules"),
    "quantization": (lambda c: bool(c.get("quantization_config")),
                     "quantized weights (e.g. V3's FP8 blocks); the recipe models its dtype's weights"),
    "batch_aux_loss": (lambda c: c.get("seq_aux") is False and bool(c.get("aux_loss_alpha")),
                       "batch-wise balance loss (seq_aux: false); scaletool's is sequence-wise"),
}
# DeepSeek config key -> recipe key, copied as they are
_MOE_KEYS = {"n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
             "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
             "first_k_dense_replace": "first_k_dense_replace", "norm_topk_prob": "norm_topk_prob",
             "routed_scaling_factor": "routed_scaling_factor", "aux_loss_alpha": "aux_loss_alpha"}
# topk_method -> the router scoring its group scores assume (see scaletool.model.moe)
_TOPK_METHODS = {"greedy": None, "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


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
    supported = {"moe"} if mtype in DEEPSEEK_TYPES else set()
    missing = [n for n in present if n not in drop and n not in supported]
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
        if "moe" in present and "moe" not in drop:
            m.update(_deepseek_moe(cfg))
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


def _deepseek_moe(cfg: dict) -> dict:
    """The MoE keys of a DeepSeek-V2/V3 config as recipe keys; routing it cannot express is an error."""
    if cfg.get("moe_layer_freq", 1) != 1:
        raise RecipeError(f"moe_layer_freq {cfg['moe_layer_freq']}: MoE in every n-th layer is not supported "
                          "(scaletool: every layer after first_k_dense_replace)")
    method = cfg.get("topk_method", "greedy")
    scoring = cfg.get("scoring_func", "softmax")
    if method not in _TOPK_METHODS:
        raise RecipeError(f"topk_method {method!r} not supported (known: {', '.join(_TOPK_METHODS)})")
    if scoring not in ("softmax", "sigmoid"):
        raise RecipeError(f"scoring_func {scoring!r} not supported (known: softmax, sigmoid)")
    if _TOPK_METHODS[method] not in (None, scoring):
        raise RecipeError(f"topk_method {method} with scoring_func {scoring}: scaletool scores groups as "
                          f"{method} does only with scoring_func {_TOPK_METHODS[method]}")
    m = {ours: cfg[theirs] for theirs, ours in _MOE_KEYS.items() if cfg.get(theirs) is not None}
    m.update(ffn="moe", scoring_func=scoring)
    if method != "greedy":  # greedy ignores n_group / topk_group
        m.update(n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1)
    return m


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
