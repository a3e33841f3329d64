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
  live with the kind, ``scaletool.kinds.attention``; this package sums them over the model.
- Mixture of experts (ffn=moe): "active" parameters are those one token multiplies (dense parts,
  router, shared experts, its top-k routed experts); ``matmul_params`` and the FLOPs count those.
  The dropless dispatch (``moe_dispatch: dropless``) computes exactly k experts per token, so FLOPs
  *computed* (what a FLOP counter sees, the ``*_computed`` keys) equal *useful* FLOPs (the MFU
  convention, the plain keys). The capacity dispatch computes every expert's full capacity buffer:
  E·C/N ≈ capacity_factor·k routed experts per token computed, k useful.
"""

from __future__ import annotations

from scaletool.analytic.comm import (  # noqa: F401
    _layer_params,
    _row,
    communication,
    data_parallel_communication,
    ddp_communication,
    fsdp_communication,
    no_communication,
    tensor_parallel_communication,
    tensor_parallel_config,
    tensor_parallel_replicated,
    wire_bytes,
    zero_communication,
)
from scaletool.analytic.engine_memory import (  # noqa: F401
    _torch_engine,
    _zero3,
    _zero12,
    ddp_memory,
    fsdp_memory,
    single_memory,
    zero_memory,
)
from scaletool.analytic.flops import (  # noqa: F401
    attention_flops_per_token,
    decode_flops_by_mode,
    decode_flops_per_token,
    flops_per_token,
    routed_experts_computed,
)
from scaletool.analytic.kv import (  # noqa: F401
    cache_bytes_per_token,
    kv_cache,
)
from scaletool.analytic.memory import (  # noqa: F401
    TABLE_ENGINES,
    compiled_memory,
    count_memory,
    engine_settings,
    memory_table,
    recipe_memory,
    tensor_parallel_memory,
    training_memory,
)
from scaletool.analytic.params import (  # noqa: F401
    _norm_params,
    attention_params,
    ffn_params,
    matmul_params,
    matmul_split,
    moe_params,
    param_counts,
)
from scaletool.analytic.step import (  # noqa: F401
    Calibration,
    default_calibration,
    fits,
    gemm_shapes,
    load_calibration,
    predict_step,
)
from scaletool.analytic.timeline import (  # noqa: F401
    COMPONENTS,
    PHASES,
    ZERO3_MAX_REUSE_DISTANCE,
    ZERO3_PREFETCH_BUCKET,
    ZERO3_SUB_GROUP_SIZE,
    ZERO_REDUCE_BUCKET,
    EngineSettings,
    MemoryInputs,
    _activation_bytes_per_token_per_layer,
    _group_sizes,
    _timeline,
    _Unit,
    _units,
)
from scaletool.config import ModelConfig, Recipe
from scaletool.kinds.engines import engine_kind

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
        "memory": {"world_size": N, "recipe": recipe_memory(recipe, N if engine_kind(recipe.parallel.engine).distributed else 1),
                   "engines": memory_table(recipe, N)},
        "communication": communication(recipe, N),
    }
