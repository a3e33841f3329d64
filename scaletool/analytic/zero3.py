"""ZeRO-3 settings scaletool derives from the model, and the ones a recipe ends up with.

DeepSpeed's own ZeRO-3 defaults are fixed element counts (prefetch 5e7, reduce bucket 5e8) and hook
every submodule: a 1B model's blocks have ~13 modules each, and each module's fetch and release runs
Python hooks and its own all-gather. scaletool instead sizes the knobs by the largest transformer
block (its parameters, all layers alike or the larger of a MoE model's dense and MoE layers):

- ``leaf_module.classes``: the block class, so each block is one ZeRO-3 leaf module (one fetch, one
  coalesced all-gather and one gradient hook per block, as FSDP2 wraps it);
- ``stage3_prefetch_bucket_size``: :data:`PREFETCH_BLOCKS` blocks' parameters gathered ahead;
- ``reduce_bucket_size``: :data:`REDUCE_BLOCKS` blocks' gradients per reduce-scatter, so gradients
  leave during the backward instead of in two flushes of 5e8 elements (one at its end);
- ``stage3_param_persistence_threshold``: DeepSpeed's 1e5, raised to d_model if that is larger, so
  every norm weight stays whole on every rank (never gathered).

The ``parallel.deepspeed.zero_optimization`` passthrough overrides any of them. Torch-free: the engine
(:mod:`scaletool.engines.deepspeed`) and the estimates read the same numbers.
"""
from __future__ import annotations

from typing import Any

from scaletool.analytic.params import attention_params, ffn_params, param_counts
from scaletool.analytic.timeline import ZERO3_PREFETCH_BUCKET, ZERO_REDUCE_BUCKET
from scaletool.config import ModelConfig, Recipe

#: the model's transformer block (scaletool.model.transformer.Block), as DeepSpeed matches leaf classes
BLOCK_CLASS = "scaletool.model.transformer.Block"
PREFETCH_BLOCKS = 2
REDUCE_BLOCKS = 2
PERSISTENCE_FLOOR = 100_000  # DeepSpeed's stage3_param_persistence_threshold default

#: DeepSpeed's ZeRO-3 values of the keys scaletool derives (deepspeed/runtime/zero/config.py), with
#: scaletool's reduce bucket of the other stages, and no leaf modules of ours: the settings before
#: scaletool derived them from the model
DEEPSPEED_DEFAULTS = {"stage3_prefetch_bucket_size": ZERO3_PREFETCH_BUCKET, "reduce_bucket_size": ZERO_REDUCE_BUCKET,
                      "stage3_param_persistence_threshold": PERSISTENCE_FLOOR, "leaf_module": {"classes": []}}


def deepspeed_as_ran(deepspeed: dict | None, zero_stage: int | None) -> dict:
    """A ``parallel.deepspeed`` passthrough with DeepSpeed's own defaults under it: the settings a run
    recorded before scaletool derived them from the model (one without ``environment.deepspeed_config``)
    ran with. The passthrough's own keys still win."""
    ds = dict(deepspeed or {})
    zero = {**DEEPSPEED_DEFAULTS, **(ds.get("zero_optimization") or {})}
    if zero_stage != 3:
        zero = {k: v for k, v in zero.items() if not k.startswith("stage3_") and k != "leaf_module"}
    ds["zero_optimization"] = zero
    return ds


def block_params(cfg: ModelConfig) -> int:
    """Parameters of the largest transformer block (attention, norms and FFN of one layer)."""
    per = param_counts(cfg)["per_layer"]
    ffn = per["ffn"]
    if cfg.n_moe_layers and cfg.n_layers > cfg.n_moe_layers:  # the leading dense layers may be larger
        ffn = max(ffn, ffn_params(cfg))
    return per["attention"] + per["norms"] + ffn


def zero3_defaults(cfg: ModelConfig) -> dict[str, Any]:
    """The ``zero_optimization`` keys scaletool sets for ZeRO-3 on this model (see the module docstring)."""
    block = block_params(cfg)
    return {"stage3_prefetch_bucket_size": PREFETCH_BLOCKS * block,
            "reduce_bucket_size": max(1, REDUCE_BLOCKS * block),
            "stage3_param_persistence_threshold": max(PERSISTENCE_FLOOR, cfg.d_model),
            "leaf_module": {"classes": [BLOCK_CLASS]}}


def zero_options(recipe: Recipe, zero_stage: int | None = None) -> dict[str, Any]:
    """The recipe's ``zero_optimization`` keys that scaletool derives or the passthrough gives, at
    ``zero_stage`` (default the recipe's): the ZeRO-3 defaults (stage 3 only) with the passthrough's
    ``zero_optimization`` over them (a nested mapping merged key by key)."""
    stage = recipe.parallel.zero_stage if zero_stage is None else zero_stage
    out = zero3_defaults(recipe.model) if stage == 3 else {}
    given = recipe.parallel.deepspeed.get("zero_optimization")
    for key, value in (given.items() if isinstance(given, dict) else ()):
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def leaf_blocks(recipe: Recipe) -> bool:
    """Whether ZeRO-3 treats each block as one leaf module under this recipe."""
    leaf = zero_options(recipe).get("leaf_module")
    classes = leaf.get("classes") if isinstance(leaf, dict) else None
    return isinstance(classes, list) and any(c in (BLOCK_CLASS, "Block") for c in classes)


def persistent_params(cfg: ModelConfig, threshold: float) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: the one-dimensional ones (norm weights, biases) of at
    most ``threshold`` elements; the matrices of a model scaletool builds are all larger."""
    if cfg.d_model > threshold:
        return 0
    pc = param_counts(cfg)
    vectors = sum(v for k, v in attention_params(cfg).items() if k.endswith(("norm", "bias")) and v <= threshold)
    return pc["norms"] + cfg.n_layers * vectors
