"""The full analytic picture of a recipe as one JSON-ready dict (what ``scaletool estimate`` reports)."""
from __future__ import annotations

from scaletool.analytic.comm import communication
from scaletool.analytic.flops import decode_flops_by_mode, flops_per_token
from scaletool.analytic.kv import kv_cache
from scaletool.analytic.memory import memory_table, recipe_memory
from scaletool.analytic.params import param_counts
from scaletool.config import ModelConfig, Recipe
from scaletool.kinds.engines import engine_kind


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
        "memory": {"world_size": N, "recipe": recipe_memory(recipe, engine_kind(recipe.parallel.engine).ranks(N)),
                   "engines": memory_table(recipe, N)},
        "communication": communication(recipe, N),
    }
